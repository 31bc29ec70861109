"""SAM 2's video memory: the memory encoder turns a frame's features and predicted mask into a
small memory map, and memory attention conditions the next frame's features on the memories of
earlier frames (and on object pointers, one token or a few per remembered frame).

State-dict compatible with the official `memory_attention` and `memory_encoder` modules. The
official configuration is fixed here: one head, RoPE on queries and keys of both attentions,
positions added to the cross-attention's keys only, pre-norm layers with a ReLU feed-forward.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.sam.modeling.attention import runs_on_kernel, sam2_attention
from genfast.sam.modeling.common import LayerNorm2d
from genfast.sam.sam2.config import Sam2Config
from genfast.sam.sam2.modeling.position import PositionEmbeddingSine

ROPE_THETA = 10000.0


class RopeTables(NamedTuple):
    """2-D axial RoPE's angles over a square grid of N tokens, as cos and sin [N, D/2] (fp32) and
    as the complex cos + i sin (None where made in compiled code, and unread there: inductor
    takes no complex tensors)."""

    cos: Tensor
    sin: Tensor
    rotations: Tensor | None


def axial_rope_tables(head_dim: int, side: int, device: torch.device, theta: float = ROPE_THETA) -> RopeTables:
    """RoPE's tables over a square row-major grid: the first head_dim/4 channel pairs rotate with
    the column index, the rest with the row."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim)
    t = torch.arange(side * side, device=device, dtype=torch.float32)
    col, row = t % side, torch.div(t, side, rounding_mode="floor")
    angles = torch.cat([torch.outer(col, freqs), torch.outer(row, freqs)], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return RopeTables(cos, sin, None if torch.compiler.is_compiling() else torch.complex(cos, sin))


def apply_rope(x: Tensor, rope: RopeTables) -> Tensor:
    """Rotate consecutive channel pairs (2i, 2i+1) of x [..., N, D] by the grid's angles (N tokens;
    a multiple of N repeats the positions, as memory frames do). Computed in fp32 as the
    official's complex product, and returned in x's dtype."""
    n = rope.cos.shape[0]
    if rope.rotations is None or torch.compiler.is_compiling():  # compiled: one fused kernel of the real form
        x0, x1 = x.float().unflatten(-2, (-1, n)).unflatten(-1, (-1, 2)).unbind(-1)  # [..., repeats, N, D/2]
        rotated = torch.stack((x0 * rope.cos - x1 * rope.sin, x0 * rope.sin + x1 * rope.cos), dim=-1)
        return rotated.flatten(-2).flatten(-3, -2).to(x.dtype)
    # Eager: one vectorized complex product, where the real form's products of strided halves
    # take ~5 passes over the keys (docs/notes.md has the timings).
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    rotated = pairs.unflatten(-2, (-1, n)) * rope.rotations
    return torch.view_as_real(rotated).flatten(-2).flatten(-3, -2).to(x.dtype)


class RoPEAttention(nn.Module):
    """Multi-head attention with axial RoPE on queries and keys. Queries are a square grid of
    tokens; keys are that grid repeated (one copy per memory frame) followed by `num_k_exclude_rope`
    tokens without position (object pointers)."""

    def __init__(self, dim: int, kv_dim: int, num_heads: int = 1) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(kv_dim, dim)
        self.v_proj = nn.Linear(kv_dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.attention_impl = "auto"  # genfast.sam.modeling.attention: the recipe's choice
        self.int8_attention = False  # q k^T and P v on int8 codes: see use_int8_attention

    def use_int8_attention(self) -> None:
        """Compute both of the attention's products on int8 codes where the kernel has them (the
        dynamic-int8 step): 4096 queries over thousands of remembered keys, where they take about
        two fifths off."""
        self.int8_attention = True

    def _heads(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        return x.view(b, n, self.num_heads, c // self.num_heads).transpose(1, 2)

    def queries(self, x: Tensor, rope: RopeTables) -> Tensor:
        """x [B, Nq, dim] -> the queries [B, heads, Nq, head_dim], projected and rotated."""
        return apply_rope(self._heads(self.q_proj(x)), rope)

    def keys(self, k: Tensor, rope: RopeTables, num_k_exclude_rope: int = 0) -> Tensor:
        """k [B, Nk, kv_dim] -> keys [B, heads, Nk, head_dim], rotated but for the last
        num_k_exclude_rope."""
        k = self._heads(self.k_proj(k))
        num_rope = k.shape[-2] - num_k_exclude_rope
        if num_rope and num_k_exclude_rope:
            k = torch.cat([apply_rope(k[..., :num_rope, :], rope), k[..., num_rope:, :]], dim=-2)
        elif num_rope:
            k = apply_rope(k, rope)
        return k

    def attend_memory(self, q: Tensor, k: Tensor, v: Tensor, rope: RopeTables, num_k_exclude_rope: int = 0) -> Tensor:
        """Queries [B, heads, Nq, head_dim] over the memory's k and v [B, Nk, kv_dim] -> [B, Nq, dim],
        before out_proj; the keys rotated as `keys` rotates them.

        With one head whose values are wider than the memory (SAM 2: 256 channels from 64), where
        the native kernel takes the call, P multiplies the memory itself and the value projection
        follows: a row of P sums to 1, so P (v W^T + b) = (P v) W^T + b, the same products
        reassociated. P v then takes kv_dim multiply-adds per query and key instead of head_dim (a
        quarter, over up to ~29K keys), and the projection runs on the Nq queries instead of the Nk
        keys. SDPA is not asked for it: its CPU flash kernel needs the values as wide as the keys."""
        keys = self.keys(k, rope, num_k_exclude_rope)
        if (
            self.num_heads == 1
            and v.shape[-1] < keys.shape[-1]
            and runs_on_kernel(q, keys.shape[-2], v.shape[-1], self.attention_impl)
        ):
            return self.v_proj(self.attend(q, keys, v.unsqueeze(1)))
        return self.attend(q, keys, self._heads(self.v_proj(v)))

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Queries [B, heads, Nq, head_dim] over keys and values [B, heads, Nk, C] -> [B, Nq,
        heads * C], before out_proj (C: head_dim, or the memory's channels: `attend_memory`)."""
        if self.attention_impl in ("auto", "fused"):  # the native kernel where it takes q
            out = sam2_attention(q, k, v, self.attention_impl, self.int8_attention)
        else:  # SDPA, as the official computes it (no step materializes 4096 x 29K scores)
            out = F.scaled_dot_product_attention(q, k, v)
        b, _, n, _ = out.shape
        return out.transpose(1, 2).reshape(b, n, -1)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, rope: RopeTables, num_k_exclude_rope: int = 0) -> Tensor:
        """q [B, Nq, dim], k and v [B, Nk, kv_dim] -> [B, Nq, dim]; rope: the grid's tables."""
        keys, values = self.keys(k, rope, num_k_exclude_rope), self._heads(self.v_proj(v))
        return self.out_proj(self.attend(self.queries(q, rope), keys, values))


class MemoryAttentionLayer(nn.Module):
    """Pre-norm layer: self-attention of the frame's tokens, cross-attention to the memory, ReLU
    feed-forward, each added back to the residual stream. (The official's dropouts are identities
    at inference and hold no parameters, so there are none here.)"""

    def __init__(self, dim: int, mem_dim: int, ffn_dim: int, num_heads: int = 1) -> None:
        super().__init__()
        self.self_attn = RoPEAttention(dim, dim, num_heads)
        self.cross_attn_image = RoPEAttention(dim, mem_dim, num_heads)
        self.linear1 = nn.Linear(dim, ffn_dim)
        self.linear2 = nn.Linear(ffn_dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        memory_with_pos: Tensor,
        rope: RopeTables,
        num_k_exclude_rope: int = 0,
    ) -> Tensor:
        """x [B, HW, dim]; memory and memory + its positions [B, M, mem_dim]."""
        x, queries = self.frame_side(x, rope)
        # Positions go into the keys only: the queries carry theirs through RoPE alone.
        attended = self.cross_attn_image.attend_memory(queries, memory_with_pos, memory, rope, num_k_exclude_rope)
        return self.output_side(x, attended)

    # The layer in three parts: the two whose shapes are the frame's alone (the recipe's compile
    # step compiles them with static shapes) around the keys and values of the memory, whose
    # length grows over the first frames of a video.

    def frame_side(self, x: Tensor, rope: RopeTables) -> tuple[Tensor, Tensor]:
        """The self-attention added to x [B, HW, dim], and the cross-attention's queries."""
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h, rope)
        return x, self.cross_attn_image.queries(self.norm2(x), rope)

    def output_side(self, x: Tensor, attended: Tensor) -> Tensor:
        """The cross-attention's output [B, HW, dim] projected and added to x, then the feed-forward."""
        x = x + self.cross_attn_image.out_proj(attended)
        return x + self.linear2(F.relu(self.linear1(self.norm3(x))))


class MemoryAttention(nn.Module):
    """Conditions the current frame's (lowest-resolution) features on the memory bank."""

    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        dim = config.d_model
        self.num_heads = 1  # every official model's
        self.layers = nn.ModuleList(
            MemoryAttentionLayer(dim, config.mem_dim, config.memory_attention_ffn_dim, self.num_heads)
            for _ in range(config.memory_attention_layers)
        )
        self.norm = nn.LayerNorm(dim)
        self._rope_cache: dict[tuple, RopeTables] = {}

    def rope_tables(self, num_tokens: int, device: torch.device) -> RopeTables:
        """RoPE's tables for a square grid of num_tokens, shared by every layer and cached
        per grid and device: the tracker asks for the same one every frame."""
        side = math.isqrt(num_tokens)
        if side * side != num_tokens:
            raise ValueError(f"memory attention needs a square feature grid, got {num_tokens} tokens")
        head_dim = self.norm.normalized_shape[0] // self.num_heads
        if torch.compiler.is_compiling():
            return axial_rope_tables(head_dim, side, device)
        key = (num_tokens, device)
        tables = self._rope_cache.get(key)
        if tables is None:
            tables = self._rope_cache[key] = axial_rope_tables(head_dim, side, device)
        return tables

    def forward(
        self,
        curr: Tensor | list[Tensor],
        memory: Tensor,
        curr_pos: Tensor | list[Tensor],
        memory_pos: Tensor,
        num_obj_ptr_tokens: int = 0,
    ) -> Tensor:
        """The official layout, sequence first:

        curr, curr_pos: [HW, B, d_model] (or a list holding that one tensor), the frame's tokens
            over a square H x W grid, row-major, and their sine positions;
        memory, memory_pos: [M, B, mem_dim], the remembered frames' tokens (each frame's HW
            tokens in the grid's order, frame after frame) followed by num_obj_ptr_tokens
            object-pointer tokens, which get no RoPE;
        returns the conditioned tokens [HW, B, d_model] (a transposed view of a batch-first tensor).
        """
        if isinstance(curr, list):
            (curr,), (curr_pos,) = curr, curr_pos
        if curr.shape[1] != memory.shape[1]:
            raise ValueError(f"batch sizes differ: {curr.shape[1]} frames' tokens, {memory.shape[1]} memories")
        rope = self.rope_tables(curr.shape[0], curr.device)
        x = (curr + 0.1 * curr_pos).transpose(0, 1)
        # Every layer adds the same positions to the memory's keys: add them once.
        memory_with_pos = (memory + memory_pos).transpose(0, 1)
        memory = memory.transpose(0, 1)
        for layer in self.layers:
            x = layer(x, memory, memory_with_pos, rope, num_obj_ptr_tokens)
        return self.norm(x).transpose(0, 1)


class MaskDownSampler(nn.Module):
    """The mask at image resolution [B, 1, S, S] -> [B, d_model, S/16, S/16]: four stride-2 3x3
    convolutions (each multiplying channels by 4, with LayerNorm2d and GELU), then a 1x1 to
    d_model. One Sequential, as the official's, for its state-dict keys."""

    def __init__(self, dim: int, num_layers: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 1
        for _ in range(num_layers):
            layers += [nn.Conv2d(channels, channels * 4, 3, stride=2, padding=1), LayerNorm2d(channels * 4), nn.GELU()]
            channels *= 4
        layers.append(nn.Conv2d(channels, dim, 1))
        self.encoder = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.encoder(x)


class CXBlock(nn.Module):
    """ConvNeXt block: depthwise 7x7 convolution, LayerNorm and a GELU MLP over channels (as
    linears on channels-last), scaled by gamma and added to the input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)  # the official LayerNorm2d, applied channels-last
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.permute(0, 3, 1, 2)


class Fuser(nn.Module):
    def __init__(self, dim: int, num_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CXBlock(dim) for _ in range(num_layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MemoryEncoder(nn.Module):
    """A frame's memory: its features plus its downsampled mask, fused by two ConvNeXt blocks and
    projected to mem_dim channels."""

    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        dim = config.d_model
        self.mask_downsampler = MaskDownSampler(dim)
        self.pix_feat_proj = nn.Conv2d(dim, dim, 1)
        self.fuser = Fuser(dim)
        self.out_proj = nn.Conv2d(dim, config.mem_dim, 1) if config.mem_dim != dim else nn.Identity()
        self.position_encoding = PositionEmbeddingSine(config.mem_dim)

    def forward(self, pix_feat: Tensor, masks: Tensor, skip_mask_sigmoid: bool = False) -> dict[str, Tensor | list]:
        """pix_feat [B, d_model, H, W] (H = W = image_size/16); masks [B, 1, 16H, 16W], logits
        unless skip_mask_sigmoid (the tracker passes its own scaled sigmoid, and True).

        Returns {"vision_features": [B, mem_dim, H, W], "vision_pos_enc": [positions, same shape]}
        as the official; the positions are a broadcast view over the batch.
        """
        if not skip_mask_sigmoid:
            masks = masks.sigmoid()
        x = self.pix_feat_proj(pix_feat) + self.mask_downsampler(masks)
        x = self.out_proj(self.fuser(x))
        return {"vision_features": x, "vision_pos_enc": [self.position_encoding(x)]}
