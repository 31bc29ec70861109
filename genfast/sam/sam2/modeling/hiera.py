"""SAM 2's image encoder: a Hiera trunk and an FPN neck.

Hiera is a plain ViT made hierarchical: a 7x7 stride-4 convolution cuts the image into patches,
then four stages of transformer blocks, each after the first starting with a block that max-pools
its queries 2x2 (halving the resolution) while doubling the width and heads. Most blocks attend
within square windows; a few attend globally. Positions are a small learned table, interpolated
to the patch grid, plus a window-sized table tiled over it.

The neck projects every stage to d_model channels with 1x1 convolutions, adds the upsampled coarser
level to the two coarsest kept levels (top-down), and drops the coarsest (1/32) level: the mask
decoder reads 1/16 as its image embedding and 1/4 and 1/8 as high-resolution features.

Parameter names follow the official checkpoints (`image_encoder.trunk.*`, `image_encoder.neck.*`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.platform import hardware
from genfast.platform.heap import in_pieces, items_per_piece
from genfast.sam.modeling.attention import sam2_attention
from genfast.sam.sam2.config import Sam2Config
from genfast.sam.sam2.modeling.linear import Linear, linear, linear_gelu
from genfast.sam.sam2.modeling.position import PositionEmbeddingSine


def window_partition(x: Tensor, window: int) -> tuple[Tensor, tuple[int, int]]:
    """[B, H, W, C] -> [B * windows, window, window, C], zero-padding H and W up to multiples of
    the window; also returns the padded size."""
    b, h, w, c = x.shape
    pad_h, pad_w = -h % window, -w % window
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    hp, wp = h + pad_h, w + pad_w
    x = x.view(b, hp // window, window, wp // window, window, c).transpose(2, 3)
    return x.reshape(-1, window, window, c), (hp, wp)


def window_unpartition(windows: Tensor, window: int, padded: tuple[int, int], size: tuple[int, int]) -> Tensor:
    """The inverse of window_partition, cropping the padding."""
    hp, wp = padded
    b = windows.shape[0] // (hp * wp // window // window)
    x = windows.reshape(b, hp // window, wp // window, window, window, -1).transpose(2, 3).reshape(b, hp, wp, -1)
    h, w = size
    return x[:, :h, :w] if (hp, wp) != (h, w) else x


def bicubic_matrix(in_size: int, out_size: int, device: torch.device) -> Tensor:
    """The [out_size, in_size] fp32 matrix of F.interpolate's 1-D bicubic resize (align_corners
    False), taken from F.interpolate itself (its weights and edge clamping) on one-hot inputs. The
    2-D resize is separable: interpolate(p) = A_h @ p @ A_w^T per channel."""
    eye = torch.eye(in_size, dtype=torch.float32, device=device)[None, :, :, None]  # one-hot rows as channels
    return F.interpolate(eye, size=(out_size, 1), mode="bicubic")[0, :, :, 0].t()


def tile_matrix(in_size: int, out_size: int, device: torch.device) -> Tensor:
    """The [out_size, in_size] one-hot matrix of tiling: row i picks i % in_size."""
    rows = torch.arange(out_size, device=device)[:, None] % in_size
    return (rows == torch.arange(in_size, device=device)[None, :]).float()


def _pool(x: Tensor, stride: int) -> Tensor:
    """2-D max pooling of a [B, H, W, C] map (kernel = stride, no padding: as nn.MaxPool2d, rows and
    columns past the last whole window dropped), as an elementwise maximum of the windows' strided
    views: channels stay innermost, where F.max_pool2d on the NCHW view made the compiled encoder
    transpose the map; and eagerly as fast as max_pool2d's channels-last kernel (a reduction over
    the reshaped view's window dimensions, x.amax(dim=(2, 4)), was 15-30x slower)."""
    b, h, w, c = x.shape
    h, w = h // stride, w // stride
    windows = x[:, : h * stride, : w * stride].reshape(b, h, stride, w, stride, c)
    out = windows[:, :, 0, :, 0]
    for i in range(stride):
        for j in range(stride):
            if i or j:
                out = torch.maximum(out, windows[:, :, i, :, j])
    return out


class MultiScaleAttention(nn.Module):
    """Multi-head self-attention whose queries may be max-pooled (`q_stride`), so the output has the
    pooled resolution while keys and values keep the full one."""

    def __init__(self, dim: int, dim_out: int, num_heads: int, q_stride: int | None, windowed: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_stride = q_stride
        self.windowed = windowed
        self.qkv = Linear(dim, dim_out * 3)
        self.proj = Linear(dim_out, dim_out)
        self.attention_impl = "auto"  # genfast.sam.modeling.attention: the recipe's choice
        self.int8_attention = False  # q k^T and P v on int8 codes: see use_int8_attention

    def use_int8_attention(self) -> None:
        """Compute both of the attention's products on int8 codes where the kernel has them (the
        dynamic-int8 step), in a global block only: over a whole 1/16-scale map (4096 keys) they
        take about a quarter off the attention, while in windows of 16-196 keys quantizing costs
        about what the products save, or more. Where the kernel's bf16 products are slower than fp32
        ones (`hardware.fast_bf16_dot_products`: int8's rate there is several times bf16's) windows
        too. (Where SDPA computes the attention instead, `attention_or_sdpa`, this asks nothing.)"""
        self.int8_attention = not self.windowed or not hardware.fast_bf16_dot_products()

    def forward(self, x: Tensor) -> Tensor:
        b, h, w, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, h * w, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        if self.q_stride:
            q = _pool(q.transpose(1, 2).reshape(b, h, w, -1), self.q_stride)
            h, w = q.shape[1:3]
            q = q.reshape(b, h * w, self.num_heads, -1).transpose(1, 2)
        out = sam2_attention(q, k, v, self.attention_impl, self.int8_attention)
        return self.proj(out.transpose(1, 2).reshape(b, h, w, -1))


class Mlp(nn.Module):
    """Two linear layers with GELU between (named `layers.0`, `layers.1` as in the checkpoints)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Linear(dim, hidden), Linear(hidden, dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.layers[1](linear_gelu(self.layers[0], x))


def _in_pieces_of_bytes(fn: Callable[[Tensor], Tensor], x: Tensor, bytes_per_item: int) -> Tensor:
    """fn(x) in pieces of x's entries whose largest intermediate, `bytes_per_item` an entry, stays
    within genfast.platform.heap's piece size. At the 1/4 and 1/8 scales the intermediates are large
    (a pooling block's qkv is 75 MB in bf16 at 1/4, 38 MB at 1/8): allocated afresh at every call,
    they are faulted in page by page by the products that write them (2-3x slower than on reused
    memory, Zen 4). In pieces glibc serves and reuses them from its heap."""
    return in_pieces(fn, x, items_per_piece(bytes_per_item))


class MultiScaleBlock(nn.Module):
    def __init__(self, dim: int, dim_out: int, num_heads: int, window: int, q_stride: int | None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.window = window  # 0: global attention
        self.q_stride = q_stride
        self.attn = MultiScaleAttention(dim, dim_out, num_heads, q_stride, windowed=window > 0)
        self.norm2 = nn.LayerNorm(dim_out, eps=1e-6)
        self.mlp = Mlp(dim_out, 4 * dim_out)
        # A stage's first block widens the residual stream too.
        self.proj = Linear(dim, dim_out) if dim != dim_out else None

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x
        x = self.norm1(x)
        if self.proj is not None:
            shortcut = self._widened_shortcut(x)
        window = self.window
        if window:
            h, w = x.shape[1:3]
            x, padded = window_partition(x, window)
            # A window's largest intermediate: its qkv.
            x = _in_pieces_of_bytes(self.attn, x, window * window * self.attn.qkv.out_features * x.element_size())
        else:
            x = self.attn(x)
        if window:
            if self.q_stride:
                # The pooled queries made each window (and the padded map) q_stride times smaller;
                # the pooled map is the shortcut's size.
                window //= self.q_stride
                h, w = shortcut.shape[1:3]
                padded = (h + -h % window, w + -w % window)
            x = window_unpartition(x, window, padded, (h, w))
        x = shortcut + x
        tokens = x.reshape(-1, x.shape[-1])
        hidden_bytes = self.mlp.layers[0].out_features * x.element_size()  # a token's, in the MLP
        return _in_pieces_of_bytes(lambda t: t + self.mlp(self.norm2(t)), tokens, hidden_bytes).view(x.shape)

    def _widened_shortcut(self, x: Tensor) -> Tensor:
        """The residual stream widened to dim_out (and pooled, in a pooling block), in strips of
        q_stride rows: the widened map before pooling is never whole (25 MB at the 1/4 scale in
        bf16)."""
        if not self.q_stride:
            return self.proj(x)
        b, h, w, c = x.shape
        stride = self.q_stride
        rows = h - h % stride  # _pool drops the rows past the last whole window
        strips = x[:, :rows].reshape(b * rows // stride, stride, w, c)
        strip_bytes = stride * w * self.proj.out_features * x.element_size()
        pooled = _in_pieces_of_bytes(lambda s: _pool(self.proj(s), stride), strips, strip_bytes)
        return pooled.view(b, rows // stride, w // stride, -1)


class PatchEmbed(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=7, stride=4, padding=3)

    def forward(self, x: Tensor) -> Tensor:
        # Channels-last in and out: the [B, H, W, C] view of the output is then contiguous, as
        # the blocks' LayerNorms and linears want it (no copy of the 1/4-scale map).
        x = self.proj(x.contiguous(memory_format=torch.channels_last))
        return x.permute(0, 2, 3, 1)  # [B, H, W, C]


class Hiera(nn.Module):
    """The trunk: [B, 3, S, S] -> each stage's output [B, C_i, S / 4 / 2^i, ...], finest first."""

    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        dim, heads = config.embed_dim, config.num_heads
        self.patch_embed = PatchEmbed(dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, dim, *config.window_pos_embed_bkg_spatial_size))
        self.pos_embed_window = nn.Parameter(torch.zeros(1, dim, config.window_spec[0], config.window_spec[0]))
        ends = [sum(config.stages[: i + 1]) - 1 for i in range(len(config.stages))]
        self.stage_ends = tuple(ends)
        self.blocks = nn.ModuleList()
        stage = 0
        for i in range(config.depth):
            dim_out = dim
            # A stage's first block still windows at the previous stage's size: its queries are
            # pooled inside the windows, which then have the new stage's size.
            window = 0 if i in config.global_att_blocks else config.window_spec[stage]
            q_stride = None
            if i - 1 in ends:
                dim_out, heads, stage = dim * 2, heads * 2, stage + 1
                q_stride = 2
            self.blocks.append(MultiScaleBlock(dim, dim_out, heads, window, q_stride))
            dim = dim_out
        # position_embedding at one patch grid, made once (precompute_position_embedding).
        self.register_buffer("precomputed_position", None, persistent=False)

    def precompute_position_embedding(self, grid: int) -> None:
        """Make the position embedding of a grid x grid patch map once, in the tables' dtype, for
        every later call at that size (others still compute theirs): it depends on the weights
        alone. For a loaded model, as the recipe's steps are: weights loaded afterwards would not
        reach it."""
        with torch.no_grad():
            self.precomputed_position = self.position_embedding(grid, grid).to(self.pos_embed.dtype)

    def position_embedding(self, h: int, w: int) -> Tensor:
        """[1, h, w, C] fp32: the background table resized bicubically to (h, w), plus the window
        table tiled over it, as matrix products in fp32 whatever the model's dtype (F.interpolate's
        bicubic kernel took 25 ms of a 1 s bf16 encoder, sam2.1-hiera-tiny on 2 Zen 4 threads;
        this ~5 ms on one, most of it writing the result). Both terms come out of the same two
        products: the tables side by side (block-diagonal, [h0 + wh, w0 + ww]) between the resize
        matrices side by side with the tiling ones, so that a compiled encoder gets the sum from
        one matrix kernel, laid out as the blocks read it, rather than a gather of the window
        table inlined into every reader of the stream."""
        table = self.pos_embed[0].permute(1, 2, 0).float()  # [h0, w0, C]
        window = self.pos_embed_window[0].permute(1, 2, 0).float()  # [wh, ww, C]
        (h0, w0, c), (wh, ww) = table.shape, window.shape[:2]
        device = table.device
        blocks = table.new_zeros(h0 + wh, w0 + ww, c)
        blocks[:h0, :w0] = table
        blocks[h0:, w0:] = window
        rows = torch.cat([bicubic_matrix(h0, h, device), tile_matrix(wh, h, device)], dim=1)  # [h, h0 + wh]
        cols = torch.cat([bicubic_matrix(w0, w, device), tile_matrix(ww, w, device)], dim=1)  # [w, w0 + ww]
        resized = cols @ blocks  # [h0 + wh, w, C]: along w, on the small table
        return (rows @ resized.view(h0 + wh, -1)).view(1, h, w, c)  # along h: one product

    def forward(self, x: Tensor) -> list[Tensor]:
        x = self.patch_embed(x)
        position = self.precomputed_position
        if position is None or position.shape[1:3] != x.shape[1:3]:
            position = self.position_embedding(*x.shape[1:3])
        x = x + position.to(x.dtype)
        outputs = []
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i in self.stage_ends:
                outputs.append(x.permute(0, 3, 1, 2))
        return outputs


class _Lateral(nn.Module):
    """A 1x1 projection (wrapped so its name is `convs.{i}.conv` as in the checkpoints).

    Computed as a linear layer (genfast/sam/sam2/modeling/linear.py) over the channels of the
    trunk's [B, H, W, C] memory, and returned as a [B, C, H, W] view of [B, H, W, C] memory (what
    the convolution returned in eager mode): a compiled encoder otherwise had the convolution
    write [B, C, H, W] memory and then transposed it (18 ms of the 1/4-scale level on one Zen 4
    thread)."""

    def __init__(self, dim: int, d_model: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, d_model, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        out = linear(x.permute(0, 2, 3, 1), self.conv.weight.flatten(1), self.conv.bias)
        return out.permute(0, 3, 1, 2)


class FpnNeck(nn.Module):
    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        # The 1/16 level's grid at the model's input size: its encoding is made once (see
        # PositionEmbeddingSine). Only that level's is used (memory attention): the official model
        # also makes the 1/4 and 1/8 levels', which nothing reads.
        grid = config.image_size // 16
        self.position_encoding = PositionEmbeddingSine(config.d_model, sizes=((grid, grid),))
        # Coarsest stage first, as the checkpoints order them.
        self.convs = nn.ModuleList(_Lateral(dim, config.d_model) for dim in config.channel_list)
        self.top_down_levels = config.fpn_top_down_levels

    def forward(self, stages: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        """Trunk outputs (finest first) -> (the three finest levels' features, the positional
        encoding of the coarsest of them)."""
        n = len(self.convs) - 1
        features: list[Tensor] = [stages[0]] * (n + 1)
        previous = None
        for i in range(n, -1, -1):
            lateral = self.convs[n - i](stages[i])
            if i in self.top_down_levels and previous is not None:
                # Nearest-neighbour upsampling copies values: exact in any dtype (the official
                # code upsamples in fp32 for the same result).
                previous = lateral + F.interpolate(previous, scale_factor=2.0, mode="nearest")
            else:
                previous = lateral
            features[i] = previous
        features = features[:-1]  # the official models drop the coarsest level
        return features, self.position_encoding(features[-1]).to(features[-1].dtype)


class ImageEncoder(nn.Module):
    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        self.trunk = Hiera(config)
        self.neck = FpnNeck(config)

    def forward(self, images: Tensor) -> tuple[list[Tensor], Tensor]:
        """Normalized images [B, 3, S, S] -> features at 1/4, 1/8 and 1/16 of the input (d_model
        channels each) and the 1/16 level's positional encoding."""
        return self.neck(self.trunk(images))
