"""tinygemm's int4 weight layout (`torch.ops.aten._weight_int4pack_mm` on CUDA), packed and
unpacked here with plain tensor ops.

aten's CUDA `_convert_weight_to_int4pack` lays codes [N, K] (0..15) out for the m16n8k16 tensor
core tile, int32 [N / 8, K / (16 T), 32, T / 2] for T inner k-tiles: word [nt, ko, lane, j]
holds eight codes of row 8 nt + lane // 4, at columns

    k = 16 T ko + 32 j + 16 parity + 8 half + 2 (lane % 4) + odd

with the code in nibble 4 odd + 2 parity + half (bits 4 nibble..4 nibble+3). aten has no op that
reads this layout back, and its kernel reads only a few rows well: a 128-token prefill through it
took 7x bf16's time on an H100. Knowing the layout, a weight is dequantized in one pass over its
codes (inductor fuses `unpack` with the scaling into the kernel that writes the bf16 weight) and
the product goes to cuBLAS. `pack` is the same map the other way: genfast packs a weight itself,
on any device, and uses tinygemm only where `layout_matches` found aten's packing identical
(a check of the installed torch, once per device: the layout is aten's internal business).
"""

from __future__ import annotations

import sys
from functools import cache

import torch
from torch import Tensor

from genfast.kernels.int4_words import nibbles_from_words, words_from_nibbles

# K in tiles of 16 x INNER_K_TILES (a lane loads 16 bytes of them at once), N in tiles of 8.
INNER_K_TILES = 8
GROUP_SIZES = (32, 64, 128, 256)
# The most rows that run tinygemm itself, one m16 tile: its time grows with each 16 rows (a
# 128-token prefill through it takes several times bf16's), where dequantizing (a Llama-2-7B
# block moves 0.94 GB: codes and grid read, the bf16 weight written and read back by cuBLAS)
# barely grows with the rows. The crossover is predicted at 16-32 rows
# (benchmarks/cuda_linear.py --rows 8,16,32,64,128 times it).
MAX_ROWS = 16

# The codes' dimensions as `pack` arranges them: rows (nt, lane // 4), columns (ko, j, parity,
# half, lane % 4, odd) -> [nt, ko, lane // 4, lane % 4, j, odd, parity, half].
_TO_PACKED = (0, 2, 1, 6, 3, 7, 4, 5)
_FROM_PACKED = tuple(_TO_PACKED.index(d) for d in range(8))


def fits(n: int, k: int, group_size: int) -> bool:
    """Whether tinygemm takes an [n, k] int4 weight in groups of `group_size` (aten's checks)."""
    return group_size in GROUP_SIZES and k % (16 * INNER_K_TILES) == 0 and n % 8 == 0


def pack(codes: Tensor, inner_k_tiles: int = INNER_K_TILES) -> Tensor:
    """Codes [N, K] (uint8, 0..15) in tinygemm's layout: what aten's CUDA
    `_convert_weight_to_int4pack` makes of them two per byte, even column in the high nibble.
    Made a few row tiles at a time (int64 words meanwhile): a 70B model's layers are quantized on
    the GPU that runs them."""
    n, k = codes.shape
    t = inner_k_tiles
    packed = torch.empty(n // 8, k // (16 * t), 32, t // 2, dtype=torch.int32, device=codes.device)
    tiles = max(1, (1 << 19) // k)  # row tiles of 8 per chunk: 4M codes
    for start in range(0, n // 8, tiles):
        chunk = codes[8 * start : 8 * (start + tiles)]
        split = chunk.reshape(-1, 8, k // (16 * t), t // 2, 2, 2, 4, 2)  # nt, lane//4, ko, j, parity, half, lane%4, odd
        nibbles = split.permute(_TO_PACKED).reshape(-1, k // (16 * t), 32, t // 2, 8)
        packed[start : start + tiles] = words_from_nibbles(nibbles)
    return packed


def unpack(packed: Tensor) -> Tensor:
    """Inverse of `pack`: the codes [N, K] (uint8) of a tinygemm weight. Element-wise on the words
    and a permutation: under torch.compile one pass with the scaling that follows."""
    nt, ko, _, half_t = packed.shape
    # nt, ko, lane//4, lane%4, j, odd, parity, half
    split = nibbles_from_words(packed).reshape(nt, ko, 8, 4, half_t, 2, 2, 2)
    return split.permute(_FROM_PACKED).reshape(nt * 8, ko * 32 * half_t)


def aten_bytes(codes: Tensor) -> Tensor:
    """Codes [N, K] as aten's `_convert_weight_to_int4pack` takes them: [N, K / 2] bytes, even
    column in the high nibble (genfast's storage form, `grids.pack_nibbles`, has it in the low)."""
    return ((codes[:, 0::2] << 4) | codes[:, 1::2]).contiguous()


def scales_and_zeros(scales: Tensor, mins: Tensor) -> Tensor:
    """tinygemm's grid [groups, N, 2] bf16 from genfast's [N, groups] scales and minima:
    w = (u - 8) * scale + zero, so zero = min + 8 * scale."""
    scales, mins = scales.float(), mins.float()
    return torch.stack([scales, mins + 8 * scales], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()


@cache
def layout_matches(device: torch.device) -> bool:
    """Whether the installed torch's CUDA `_convert_weight_to_int4pack` makes `pack`'s layout on
    `device` (an Ampere or later GPU): checked once, on a random weight two tiles each way."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 32 * INNER_K_TILES), dtype=torch.uint8, generator=generator).to(device)
    theirs = torch.ops.aten._convert_weight_to_int4pack(aten_bytes(codes), INNER_K_TILES)
    if torch.equal(theirs, pack(codes)):
        return True
    print(
        f"genfast: torch {torch.__version__} lays tinygemm's int4 weights out differently from what genfast "
        "reads; int4 runs genfast's Triton kernels instead",
        file=sys.stderr,
    )
    return False
