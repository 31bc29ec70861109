"""`torch.ops.genfast.mxfp4_expert_linear`: rows times their own expert's MXFP4 weight, read as
4-bit codes in the kernel's layout (made here, `pack`). Every variant (<isa>.cpp; the shared host
code and the layout notes are in mxfp4_linear.h) reads the same layout. Where no variant runs,
genfast.quant.mxfp4 unpacks and dequantizes the same buffer instead.

Layout of one expert's weight [N, K] (N padded with zero rows to whole row groups of 64):
[row group][block of 32 columns][tile of 16 rows][chunk c of 8 columns][row][byte j], byte j
holding column 8c + j in its low nibble and 8c + 4 + j in its high one (so that one 64-byte vector
is 16 rows x 4 columns, the shape of a VNNI dot product into 16 sums), and after each block's four
tiles (1024 bytes) the 64 rows' E8M0 scales (64 bytes): 17 bytes per row and block, as in the
checkpoint, in one contiguous stream per row group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genfast.kernels.native import Kernel, Variant

KERNEL = Kernel(
    "mxfp4_linear",
    "MXFP4 expert linear kernel",
    (Variant("avx512", ("avx512_vnni",), ("-mavx512vnni",)), Variant("avx2")),
    rank=6,
)

BLOCK = 32  # columns sharing one scale
ROW_GROUP = 64  # output rows per unit of work
TILE_ROWS = 16
BLOCK_BYTES = ROW_GROUP * (BLOCK // 2 + 1)  # one row group's block: codes then scales


def unavailable_reason() -> str | None:
    """Why no native MXFP4 kernel runs here, or None when one is loaded and ready."""
    return KERNEL.unavailable_reason()


def available() -> bool:
    return unavailable_reason() is None


def padded_rows(out_features: int) -> int:
    return -(-out_features // ROW_GROUP) * ROW_GROUP


# The schema lives here, not in C++, so the op (and its shape function for torch.compile) exists
# whether or not the native library could be built.
torch.library.define(
    "genfast::mxfp4_expert_linear", "(Tensor x, Tensor experts, Tensor packed, int out_features) -> Tensor"
)


@torch.library.register_fake("genfast::mxfp4_expert_linear")
def _mxfp4_expert_linear_fake(x: Tensor, experts: Tensor, packed: Tensor, out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


def pack(codes: Tensor, scales: Tensor) -> Tensor:
    """codes [..., N, K/32, 32] (one 4-bit code a byte, in column order) and E8M0 scales
    [..., N, K/32] (uint8) -> the kernel's layout [..., bytes] (see the module's docstring)."""
    *lead, n, blocks, _ = codes.shape
    rows = padded_rows(n)
    if rows != n:
        codes = torch.cat([codes, codes.new_zeros(*lead, rows - n, blocks, BLOCK)], dim=-3)
        scales = torch.cat([scales, scales.new_zeros(*lead, rows - n, blocks)], dim=-2)
    groups, tiles = rows // ROW_GROUP, ROW_GROUP // TILE_ROWS
    # (..., s, t, r, b, c, half, j) -> nibbles (..., s, t, r, b, c, j) -> (..., s, b, t, c, r, j)
    view = codes.reshape(*lead, groups, tiles, TILE_ROWS, blocks, 4, 2, 4)
    nibbles = view[..., 0, :] | (view[..., 1, :] << 4)
    d = len(lead)
    order = (*range(d), d, d + 3, d + 1, d + 4, d + 2, d + 5)
    tiled = nibbles.permute(order).reshape(*lead, groups, blocks, ROW_GROUP * BLOCK // 2)
    grid = scales.reshape(*lead, groups, ROW_GROUP, blocks).transpose(-1, -2)
    return torch.cat([tiled, grid], dim=-1).reshape(*lead, -1).contiguous()


def unpack(packed: Tensor, out_features: int, in_features: int) -> tuple[Tensor, Tensor]:
    """Inverse of pack: codes [..., N, K/32, 32] and scales [..., N, K/32]."""
    *lead, _ = packed.shape
    rows, blocks = padded_rows(out_features), in_features // BLOCK
    groups, tiles = rows // ROW_GROUP, ROW_GROUP // TILE_ROWS
    view = packed.reshape(*lead, groups, blocks, BLOCK_BYTES)
    tiled = view[..., : ROW_GROUP * BLOCK // 2].reshape(*lead, groups, blocks, tiles, 4, TILE_ROWS, 4)
    nibbles = torch.stack([tiled & 0x0F, tiled >> 4], dim=-2)  # (..., s, b, t, c, r, half, j)
    d = len(lead)
    order = (*range(d), d, d + 2, d + 4, d + 1, d + 3, d + 5, d + 6)  # -> (..., s, t, r, b, c, half, j)
    codes = nibbles.permute(order).reshape(*lead, rows, blocks, BLOCK)
    scales = view[..., ROW_GROUP * BLOCK // 2 :].transpose(-1, -2).reshape(*lead, rows, blocks)
    return codes[..., :out_features, :, :], scales[..., :out_features, :]
