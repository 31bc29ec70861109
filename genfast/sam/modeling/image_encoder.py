"""SAM's image encoder: a ViTDet-style ViT with windowed and global attention, then a conv neck.

- Most blocks attend within 14x14 windows (the 64x64 token grid is zero-padded to 70x70 for
  that); a few blocks, `global_attn_indexes`, attend over the whole grid.
- Every attention adds a decomposed relative-position bias (MViTv2): for a query at (h, w) and a
  key at (h', w'), q . Rh[h - h'] + q . Rw[w - w'], with the unscaled query, after scaling q . k.
  The two small per-query tables are computed here; modeling/attention.py adds them (as a
  materialized mask for SDPA, or inside the fused kernel).
- The input must be exactly image_size square: the absolute position embedding is added
  unresized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.sam.config import SamConfig
from genfast.sam.modeling.attention import rel_pos_attention
from genfast.sam.modeling.common import LayerNorm2d, MLPBlock


def relative_positions(size: int, table: Tensor) -> Tensor:
    """[size, size, C] embeddings of the offsets between query i and key j, table[i - j + size - 1].

    Query and key grids have the same size here, so the offsets index the table directly (the
    original also interpolates tables of other lengths; SAM's fixed input never needs that).
    """
    if table.shape[0] != 2 * size - 1:
        raise ValueError(f"relative position table has {table.shape[0]} rows, expected {2 * size - 1}")
    idx = torch.arange(size, device=table.device)
    return table[idx[:, None] - idx[None, :] + (size - 1)]


def rel_pos_tables(q: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, h: int, w: int) -> tuple[Tensor, Tensor]:
    """The decomposed relative-position bias of queries q [B, heads, h*w, C] as two tables:
    [B, heads, h*w, h] (one term per key row) and [B, heads, h*w, w] (one per key column)."""
    b, n_heads, _, c = q.shape
    r_q = q.reshape(b, n_heads, h, w, c)
    rel_h = torch.einsum("bnhwc,hkc->bnhwk", r_q, relative_positions(h, rel_pos_h))
    rel_w = torch.einsum("bnhwc,wkc->bnhwk", r_q, relative_positions(w, rel_pos_w))
    return rel_h.reshape(b, n_heads, h * w, h), rel_w.reshape(b, n_heads, h * w, w)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, grid: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        # One row per offset -(grid-1)..(grid-1) along each axis.
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * grid - 1, head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * grid - 1, head_dim))
        self.attention_impl = "auto"  # see modeling/attention.py

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, H, W, C] (B counts windows for windowed blocks)."""
        b, h, w, dim = x.shape
        q, k, v = self.qkv(x).reshape(b, h * w, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        rel_h, rel_w = rel_pos_tables(q, self.rel_pos_h, self.rel_pos_w, h, w)
        x = rel_pos_attention(q, k, v, rel_h, rel_w, self.attention_impl)  # [B, heads, h*w, C]
        return self.proj(x.transpose(1, 2).reshape(b, h, w, dim))


def window_partition(x: Tensor, window: int) -> tuple[Tensor, tuple[int, int]]:
    """[B, H, W, C] -> [B * windows, window, window, C], zero-padding H and W up to multiples of
    `window`; also returns the padded (H, W)."""
    b, h, w, c = x.shape
    pad_h, pad_w = -h % window, -w % window
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    hp, wp = h + pad_h, w + pad_w
    x = x.view(b, hp // window, window, wp // window, window, c).transpose(2, 3)
    return x.reshape(-1, window, window, c), (hp, wp)


def window_unpartition(windows: Tensor, window: int, padded: tuple[int, int], size: tuple[int, int]) -> Tensor:
    """Inverse of window_partition, dropping the padding."""
    (hp, wp), (h, w) = padded, size
    c = windows.shape[-1]
    x = windows.view(-1, hp // window, wp // window, window, window, c).transpose(2, 3)
    x = x.reshape(-1, hp, wp, c)
    return x[:, :h, :w].contiguous() if (hp, wp) != (h, w) else x


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, window: int, grid: int) -> None:
        super().__init__()
        self.window_size = window  # 0: global attention
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, window or grid)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLPBlock(dim, int(dim * mlp_ratio), nn.GELU)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        if self.window_size:
            size = h.shape[1:3]
            h, padded = window_partition(h, self.window_size)
            h = window_unpartition(self.attn(h), self.window_size, padded, size)
        else:
            h = self.attn(h)
        x = x + h
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).permute(0, 2, 3, 1)  # [B, H, W, C]


class ImageEncoderViT(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.img_size = config.image_size
        dim, grid = config.encoder_embed_dim, config.image_embedding_size
        self.patch_embed = PatchEmbed(config.patch_size, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, grid, grid, dim))
        self.blocks = nn.ModuleList(
            Block(
                dim,
                config.encoder_num_heads,
                config.mlp_ratio,
                0 if i in config.encoder_global_attn_indexes else config.window_size,
                grid,
            )
            for i in range(config.encoder_depth)
        )
        out = config.prompt_embed_dim
        self.neck = nn.Sequential(
            nn.Conv2d(dim, out, kernel_size=1, bias=False),
            LayerNorm2d(out),
            nn.Conv2d(out, out, kernel_size=3, padding=1, bias=False),
            LayerNorm2d(out),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Normalized, padded images [B, 3, S, S] -> image embeddings [B, prompt_dim, S/16, S/16]."""
        x = self.patch_embed(x) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.neck(x.permute(0, 3, 1, 2))
