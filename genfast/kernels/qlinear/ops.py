"""`torch.ops.genfast.qlinear` (weight-only: activations quantized to int8 per block of 32) and
`torch.ops.genfast.qlinear_dynamic` (per-token int8 activations) over weights in the kernel's
packed layout, made here (`pack`). Every variant (<isa>.cpp; avx512.h has the math) reads the
same layout. Where no variant runs (`available() == False`) genfast.quant.linear keeps the codes
in their storage form and dequantizes them instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genfast.kernels.native import Kernel, Variant

KERNEL = Kernel(
    "qlinear",
    "int8/int4 linear kernel",
    (
        Variant("amx", ("avx512_vnni", "amx_int8"), ("-mavx512vnni", "-mamx-int8")),
        Variant("avx512", ("avx512_vnni",), ("-mavx512vnni",)),
        Variant("avx2"),
    ),
    rank=0,
)

# The largest magnitude `qlinear_dynamic` quantizes activations to, per token, per variant: 8 bits
# where the variant has an int8 dot product (VNNI), 7 bits in the AVX2 one, whose vpmaddubsw sums
# pairs of u8 x s8 products into int16 (2 x 255 x 63 fits; 2 x 255 x 127 would saturate). Seven
# bits let it multiply the stored codes directly, faster than 8-bit activations with the sign
# moved onto them (avx2.cpp).
DYNAMIC_ACTIVATION_MAX = {"amx": 127, "avx512": 127, "avx2": 63}

TILE_ROWS = 16  # output rows per tile
ROW_GROUP = 64  # rows per unit of work (4 tiles); weights are padded with zero rows to a multiple


def unavailable_reason() -> str | None:
    """Why no native quantized-linear kernel runs here, or None when one is loaded and ready."""
    return KERNEL.unavailable_reason()


def available() -> bool:
    return unavailable_reason() is None


def dynamic_activation_max() -> int:
    """The largest magnitude `qlinear_dynamic` quantizes activations to, per token, in the loaded
    variant (DYNAMIC_ACTIVATION_MAX); 127 where none is loaded."""
    return DYNAMIC_ACTIVATION_MAX.get(KERNEL.loaded_isa() or "", 127)


# The schemas live here, not in C++, so the ops (and their shape functions for torch.compile) exist
# whether or not the native library could be built.
torch.library.define(
    "genfast::qlinear", "(Tensor x, Tensor packed, int bits, int group_size, int out_features) -> Tensor"
)


# bias (fp32 or bf16, [out_features]) and gelu: the epilogue applied to the fp32 outputs before they are
# rounded (qlinear.h).
torch.library.define(
    "genfast::qlinear_dynamic",
    "(Tensor x, Tensor packed, int out_features, Tensor? bias=None, bool gelu=False) -> Tensor",
)


@torch.library.register_fake("genfast::qlinear_dynamic")
def _qlinear_dynamic_fake(
    x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None = None, gelu: bool = False
) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("genfast::qlinear")
def _qlinear_fake(x: Tensor, packed: Tensor, bits: int, group_size: int, out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


# Codes [N, K] viewed as (row group s, tile t, row r, block b, chunk c, [nibble half h,] byte j);
# the kernel wants (s, b, t, c, r, j): see the layout notes in avx512.h.
_TILES = ROW_GROUP // TILE_ROWS


def pack(codes: Tensor, scales: Tensor, mins: Tensor, bits: int) -> Tensor:
    """The kernel's single weight buffer. codes [N_padded, K], scales and mins [N_padded, groups]
    (fp16). Per row group of 64 rows, per group of columns: the group's tiled codes, then the 64
    rows' scales, then their minima (qlinear.h), so that a thread's task is one
    contiguous stream."""
    n, groups = codes.shape[0], scales.shape[1]
    tiles = pack_tiles(codes, bits).reshape(n // ROW_GROUP, groups, -1)  # a group's blocks are consecutive
    grids = [t.reshape(n // ROW_GROUP, ROW_GROUP, groups).transpose(1, 2).contiguous() for t in (scales, mins)]
    grid_bytes = [g.view(torch.uint8) for g in grids]  # [row group, group, 64 x 2 bytes]
    return torch.cat([tiles, *grid_bytes], dim=2).reshape(-1)


def unpack(packed: Tensor, bits: int, n: int, k: int, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of pack: codes [n, k], scales and mins [n, k // group_size]."""
    groups = k // group_size
    code_bytes = group_size * ROW_GROUP * bits // 8
    view = packed.reshape(n // ROW_GROUP, groups, code_bytes + 4 * ROW_GROUP)
    codes = unpack_tiles(view[..., :code_bytes].reshape(-1), bits, n, k)
    grids = view[..., code_bytes:].contiguous().view(torch.float16).reshape(n // ROW_GROUP, groups, 2, ROW_GROUP)
    scales, mins = (grids[:, :, i].transpose(1, 2).reshape(n, groups) for i in range(2))
    return codes, scales, mins


def pack_tiles(codes: Tensor, bits: int) -> Tensor:
    """Codes [N_padded, K] (uint8, N_padded a multiple of 64, K of 32) -> the kernel's layout."""
    n, k = codes.shape
    if bits == 8:
        view = codes.reshape(n // ROW_GROUP, _TILES, TILE_ROWS, k // 32, 8, 4)
    else:
        halves = codes.reshape(n // ROW_GROUP, _TILES, TILE_ROWS, k // 32, 4, 2, 4)
        view = halves[..., 0, :] | (halves[..., 1, :] << 4)
    return view.permute(0, 3, 1, 4, 2, 5).contiguous().reshape(-1)


def unpack_tiles(packed: Tensor, bits: int, n: int, k: int) -> Tensor:
    """Inverse of pack_tiles: [N_padded, K] codes."""
    chunks = 8 if bits == 8 else 4
    view = packed.reshape(n // ROW_GROUP, k // 32, _TILES, chunks, TILE_ROWS, 4).permute(0, 2, 4, 1, 3, 5)
    if bits == 4:
        view = torch.stack([view & 0x0F, view >> 4], dim=-2)
    return view.reshape(n, k)
