"""Weight-only int8/int4 linear on CUDA: Triton kernels over the codes of `genfast.quant.grids`.

Decode at batch 1 is a matrix-vector product that must stream the weight at the memory's rate.
torch's own CUDA kernels do not for these formats (`_weight_int8pack_mm` streams a small fraction
of it, tinygemm's int4 at groups of 32 under half of what cuBLAS bf16 does; benchmarks/
cuda_linear.py measures them), so the codes are read here directly:

    w[n, k] = u[n, k] * scale[n, g] + min[n, g],   g = k // group_size

with scales and minima fp16 [N, K // group_size] and the codes u stored (`store_codes`) as
- int8: one byte each, [N, K], the storage form itself;
- int4: int32 words, [N, K / 8]. Each 32 columns of a row are four words; nibble j of word i holds
  column 4j + i. A thread then reads a block's 32 codes in one 16-byte load, and takes code j of
  all four words with the same mask: no byte shuffles, and the columns it multiplies are 4
  contiguous ones per nibble.

Two kernels:

- `_gemv`: one row. Each program owns BLOCK_N output rows and walks K in sub-blocks of SUB columns
  (NG groups of GS columns: a scale each for int8, 32-column blocks for int4; held as a third tile
  dimension so a small group never shrinks the loads). The products accumulate element-wise in
  fp32 and are summed once at the end, so the loop is loads and fused multiply-adds. Codes become
  floats through the exponent trick (OR-ed under the exponent of a power of two, minus that power),
  two full-rate ops instead of a quarter-rate integer conversion. Per group the loop multiplies the
  codes alone and scales their sum (one scale per row: once at the end); the minima's part,
  sum_g min[n, g] * (sum of x over group g), comes after the loop. (X_SUMS, a candidate not yet
  timed: it comes in the loop instead, from x's sums per group made before the launch, without
  the pass's barriers.) x is read in fp32 (the caller
  casts it: inside a compiled step that cast fuses into the op that made x), which saves a
  conversion per product. The loop is bound by instruction issue before memory on an H100 (its
  132 SMs issue 128 thread-instructions per cycle each; streaming its HBM3 at full rate needs ~12
  bytes of codes per SM and cycle), so what counts is instructions per byte of codes:
  `benchmarks/triton_sass.py` compiles the kernel for sm_90 without a GPU and counts them.
- `_gemm`: a few rows (speculative verification, a serving batch, short prefills):
  each sub-block is dequantized to the activations' dtype in registers and multiplied with tl.dot,
  so the weight is still read once per BLOCK_M rows. int4 takes one product per nibble (x read at
  that nibble's columns), so that a thread dequantizes the words it loaded, in place.

Longer inputs (prefill) are compute-bound: the caller dequantizes and uses cuBLAS.
The summation order is fixed by the configuration: along K by SUB and SPLIT_K (K cut into that
many slices, one program each, whose fp32 partial sums are added in order afterwards, for
matrices with few rows and many columns), and in the last sum over a tile's lanes by the tile's
layout, which BLOCK_N and num_warps can change. Eager and compiled code take the same
configuration for the same shape, so they agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from genfast.kernels.int4_words import nibbles_from_words, words_from_nibbles


@triton.jit
def _as_float(u):
    """Small non-negative int32 -> fp32, exactly, without the integer-to-float conversion unit:
    OR-ed into the bits of 2.0**23 (0x4B000000) an integer u < 2**23 gives the float 2**23 + u."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _nibble(words, j: tl.constexpr, exponent):
    """Code j (bits 4j..4j+3, j <= 4) of int32 words as fp32, exactly and without a shift: under
    the exponent of 2**(23 - 4j), mantissa bit 4j is worth 1, so the masked word OR-ed with that
    exponent is the float 2**(23 - 4j) + code. `exponent` is 2**23's (0x4B000000), passed at run time: as a
    second immediate beside the mask it would cost ptxas a second LOP3 per code."""
    bits = (words & (15 << (4 * j))) | (exponent - ((4 * j) << 23))
    return bits.to(tl.float32, bitcast=True) - (2.0 ** (23 - 4 * j))


@triton.jit
def _grid_tile(grid_ptr, rows, row_ok, k, stride_grid, GROUP: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr):
    """The scales (or minima) of a sub-block's NG groups of GS columns, [BLOCK_N, NG, 1] in fp32."""
    grid = rows[:, None] * stride_grid + ((k + tl.arange(0, NG) * GS) // GROUP)[None, :]
    return tl.load(grid_ptr + grid, mask=row_ok[:, None], other=0.0).to(tl.float32)[:, :, None]


@triton.jit
def _gemv_scales(grid_ptr, rows, row_ok, k, stride_grid, GROUP: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr,
                 TIES_FIRST: tl.constexpr):  # fmt: skip
    """`_grid_tile` in the one-row kernel's layout of its codes (a thread holds rows of one group).
    The grid's pointers are contiguous along neither rows nor groups, and where contiguity ties,
    Triton before 3.7 makes the first dimension the fastest and later versions the last: each way
    needs its own tile, or the scales go through shared memory at every step."""
    if TIES_FIRST:
        grid = rows[None, :] * stride_grid + ((k + tl.arange(0, NG) * GS) // GROUP)[:, None]
        return tl.trans(tl.load(grid_ptr + grid, mask=row_ok[None, :], other=0.0)).to(tl.float32)[:, :, None]
    return _grid_tile(grid_ptr, rows, row_ok, k, stride_grid, GROUP, GS, NG)


@triton.jit
def _word_columns(k, NG: tl.constexpr):
    """The columns of nibble 0 of the NG * 4 int4 words from column k, [1, NG * 4]: word i of
    block g holds column 32g + i there (nibble j: 4j further), runs of 4 contiguous."""
    flat = tl.arange(0, NG * 4)[None, :]
    return tl.max_contiguous(tl.multiple_of(k + (flat // 4) * 32 + flat % 4, [1, 4]), [1, 4])


@triton.jit
def _x_tile(x_rows, columns, shape: tl.constexpr):
    """x at `columns` ([1, SPAN], runs of 4 contiguous) through the rows' tile of equal pointers, as `shape`."""
    columns = tl.max_contiguous(tl.multiple_of(columns, [1, 4]), [1, 4])
    return tl.reshape(tl.load(x_rows + columns), shape).to(tl.float32)


@triton.jit
def _gemv_sub(acc, x_ptr, codes_ptr, scales_ptr, rows, row_ok, k, stride_codes, stride_grid, exponent,
              BITS: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr,
              LANES: tl.constexpr, PER_ROW: tl.constexpr, TIES_FIRST: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, NG, LANES] += the scaled products of the codes of one sub-block from column k
    (int8: NG groups of GS columns, a lane per column; int4: NG blocks of 32 columns, a lane per
    word) with x, without the minima. PER_ROW (one scale per row): unscaled, scaled at the end."""
    # x is read through a [BLOCK_N, ...] tile of equal rows, so that it gets the codes' layout (read
    # as one row it gets a layout of its own, moved through shared memory at every step) and is
    # loaded once for all the rows a thread holds.
    shape: tl.constexpr = [rows.shape[0], NG, LANES]
    x_rows = x_ptr + tl.zeros_like(rows)[:, None]
    if BITS == 4:  # code j of word `lane` is column 4j + lane of its block
        # The words come in as one contiguous [BLOCK_N, NG * 4] tile, reshaped: as a 3D tile their
        # pointers are contiguous along the lanes only, and Triton orders rows and groups by its
        # tie-break, which changed in 3.7: with 3.6 each thread held one row and loaded x once per
        # row, 9.1 bytes per byte of codes. (k is a multiple of the sub-block, >= 32 columns.)
        flat = tl.arange(0, NG * LANES)[None, :]
        start = tl.multiple_of(k // 8, 4)
        words = tl.load(codes_ptr + rows[:, None] * stride_codes + (start + flat), mask=row_ok[:, None], other=0)
        words = tl.reshape(words, shape)
        high = words >> 12  # codes 5..7 to bits 8..19, where _nibble reads codes 2..4
        columns = _word_columns(k, NG)
        codes_dot = _nibble(words, 0, exponent) * _x_tile(x_rows, columns, shape)
        for j in tl.static_range(1, 8):
            code = _nibble(words, j, exponent) if j < 5 else _nibble(high, j - 3, exponent)
            codes_dot += code * _x_tile(x_rows, columns + 4 * j, shape)
    else:  # the same for int8's bytes, a lane per column, whose groups tie with the rows too
        columns = tl.max_contiguous(tl.multiple_of(k + tl.arange(0, NG * LANES)[None, :], [1, 16]), [1, 16])
        u = tl.load(codes_ptr + rows[:, None] * stride_codes + columns, mask=row_ok[:, None], other=0)
        u = _as_float(tl.reshape(u, shape).to(tl.int32))
        codes_dot = u * _x_tile(x_rows, columns, shape)
    if PER_ROW:
        return acc + codes_dot
    return acc + _gemv_scales(scales_ptr, rows, row_ok, k, stride_grid, GROUP, GS, NG, TIES_FIRST) * codes_dot


@triton.jit
def _gemv_mins(acc_mins, mins_ptr, x_sums_ptr, rows, row_ok, k, stride_grid, GROUP: tl.constexpr,
               GS: tl.constexpr, NG: tl.constexpr, TIES_FIRST: tl.constexpr):  # fmt: skip
    """acc_mins [BLOCK_N, NG, 1] += min[n, g] * (sum of x over group g) for one sub-block from
    column k, the sums of x given (x_sums: one per GS columns), both tiles in the scales' layout."""
    mins = _gemv_scales(mins_ptr, rows, row_ok, k, stride_grid, GROUP, GS, NG, TIES_FIRST)
    return acc_mins + mins * _gemv_scales(x_sums_ptr, rows, row_ok, k, 0, GS, GS, NG, TIES_FIRST)


@triton.jit
def _gemv(x_ptr, codes_ptr, scales_ptr, mins_ptr, x_sums_ptr, out_ptr, N, K, K_SPLIT, stride_codes, stride_grid,
          exponent, BITS: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr,
          LANES: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, PER_ROW: tl.constexpr,
          TIES_FIRST: tl.constexpr, X_SUMS: tl.constexpr):  # fmt: skip
    """Program (i, j): rows i * BLOCK_N.., columns j * K_SPLIT.. up to K_SPLIT of them, its sum
    stored to out[j] (one split: the output itself; several: fp32 partial sums). X_SUMS: the
    minima's part in the loop, from x's sums per GS columns (x_sums_ptr, made by the caller;
    never with PER_ROW)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.zeros([BLOCK_N, NG, LANES], dtype=tl.float32)
    acc_mins = tl.zeros([BLOCK_N, NG, 1], dtype=tl.float32)
    sub: tl.constexpr = GS * NG
    block_k = sub * UNROLL
    begin = tl.program_id(1) * K_SPLIT
    end = tl.minimum(begin + K_SPLIT, K)
    whole = end - (end - begin) % block_k
    for k0 in range(begin, whole, block_k):
        for j in tl.static_range(UNROLL):
            acc = _gemv_sub(acc, x_ptr, codes_ptr, scales_ptr, rows, row_ok, k0 + j * sub, stride_codes, stride_grid,
                            exponent, BITS, GROUP, GS, NG, LANES, PER_ROW, TIES_FIRST)  # fmt: skip
            if X_SUMS:
                acc_mins = _gemv_mins(acc_mins, mins_ptr, x_sums_ptr, rows, row_ok, k0 + j * sub, stride_grid, GROUP,
                                      GS, NG, TIES_FIRST)  # fmt: skip
    for k in range(whole, end, sub):
        acc = _gemv_sub(acc, x_ptr, codes_ptr, scales_ptr, rows, row_ok, k, stride_codes, stride_grid, exponent,
                        BITS, GROUP, GS, NG, LANES, PER_ROW, TIES_FIRST)  # fmt: skip
        if X_SUMS:
            acc_mins = _gemv_mins(acc_mins, mins_ptr, x_sums_ptr, rows, row_ok, k, stride_grid, GROUP, GS, NG,
                                  TIES_FIRST)  # fmt: skip
    total = tl.sum(tl.sum(acc, axis=2), axis=1)
    # Without X_SUMS, the minima's part, sum_g min[n, g] * sum_{k in g} x_k over this program's
    # columns, comes after the loop: inside it, each product would add the minimum's share (an
    # instruction per code).
    if X_SUMS:
        total += tl.sum(tl.sum(acc_mins, axis=2), axis=1)
    elif PER_ROW:
        x_sum = tl.zeros([sub], dtype=tl.float32)
        for k in range(begin, end, sub):
            x_sum += tl.load(x_ptr + k + tl.arange(0, sub)).to(tl.float32)
        scale = tl.load(scales_ptr + rows * stride_grid, mask=row_ok, other=0.0).to(tl.float32)
        low = tl.load(mins_ptr + rows * stride_grid, mask=row_ok, other=0.0).to(tl.float32)
        total = scale * total + low * tl.sum(x_sum, axis=0)
    else:  # per 32-column block (a group holds whole blocks)
        blocks = tl.arange(0, sub // 32)
        for k in range(begin, end, sub):
            x_blocks = tl.load(x_ptr + k + blocks[:, None] * 32 + tl.arange(0, 32)[None, :]).to(tl.float32)
            grid = rows[:, None] * stride_grid + ((k + blocks * 32) // GROUP)[None, :]
            low = tl.load(mins_ptr + grid, mask=row_ok[:, None], other=0.0).to(tl.float32)
            total += tl.sum(low * tl.sum(x_blocks, axis=1)[None, :], axis=1)
    out = out_ptr + tl.program_id(1) * N + rows
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemm(x_ptr, codes_ptr, scales_ptr, mins_ptr, out_ptr, M, N, K, K_SPLIT, stride_x, stride_out, stride_codes,
          stride_grid, exponent, BITS: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr,
          SUB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """Program (i, t, j): rows i * BLOCK_N.. of tokens t * BLOCK_M.., columns j * K_SPLIT.. up to
    K_SPLIT of them, its product stored to out[j] (one split: the output itself; several: fp32
    partial sums)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    token_ok = tokens < M
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + tokens[:, None] * stride_x
    begin = tl.program_id(2) * K_SPLIT
    for k in range(begin, tl.minimum(begin + K_SPLIT, K), SUB):
        if BITS == 4:  # NG blocks of 32 columns (GS = 32), four words each: code j of word i is column 4j + i
            # One product per nibble j, over the sub-block's NG * 4 columns 32g + 4j + i (x read at
            # those), so that a thread's words become its own codes in place, 4 contiguous per row
            # for shared memory. As one tile of the columns in order, each word was spread over 8
            # threads, a scale converted per code and each code stored alone: 22.6 instructions per
            # byte of codes, now ~11 (benchmarks/triton_sass.py --kernel few-row).
            flat = tl.arange(0, NG * 4)[None, :]
            words = tl.load(codes_ptr + rows[:, None] * stride_codes + (k // 8 + flat), mask=row_ok[:, None], other=0)
            scale = _block_tile(scales_ptr, rows, row_ok, k, stride_grid, GROUP, NG)
            low = _block_tile(mins_ptr, rows, row_ok, k, stride_grid, GROUP, NG)
            high = words >> 12  # codes 5..7 to bits 8..19, where _nibble reads codes 2..4
            columns = _word_columns(k, NG)
            for j in tl.static_range(8):
                code = _nibble(words, j, exponent) if j < 5 else _nibble(high, j - 3, exponent)
                x = tl.load(x_rows + columns + 4 * j, mask=token_ok[:, None], other=0.0)
                acc = _dot(x, (code * scale + low).to(dtype), acc, IEEE)
        else:
            group = tl.arange(0, NG)[None, :, None]
            lane = tl.arange(0, GS)[None, None, :]
            scale = _grid_tile(scales_ptr, rows, row_ok, k, stride_grid, GROUP, GS, NG)
            low = _grid_tile(mins_ptr, rows, row_ok, k, stride_grid, GROUP, GS, NG)
            u = tl.load(codes_ptr + rows[:, None, None] * stride_codes + (k + group * GS + lane),
                        mask=row_ok[:, None, None], other=0)  # fmt: skip
            w = tl.reshape((_as_float(u.to(tl.int32)) * scale + low).to(dtype), [BLOCK_N, SUB])
            x = tl.load(x_rows + k + tl.arange(0, SUB)[None, :], mask=token_ok[:, None], other=0.0)
            acc = _dot(x, w, acc, IEEE)
    out = out_ptr + tl.program_id(2) * M * stride_out + tokens[:, None] * stride_out + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=token_ok[:, None] & row_ok[None, :])


@triton.jit
def _block_tile(grid_ptr, rows, row_ok, k, stride_grid, GROUP: tl.constexpr, NG: tl.constexpr):
    """The scales (or minima) of NG 32-column blocks from column k, each repeated for its four
    words: [BLOCK_N, NG * 4] in fp32."""
    grid = _grid_tile(grid_ptr, rows, row_ok, k, stride_grid, GROUP, 32, NG)
    return tl.reshape(tl.broadcast_to(grid, [rows.shape[0], NG, 4]), [rows.shape[0], NG * 4])


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr):
    """acc + x w^T; fp32 inputs exactly (IEEE), as a float32 matmul would be."""
    if IEEE:
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


def store_codes(codes: Tensor, bits: int) -> Tensor:
    """The kernels' form of codes [N, K] (uint8, K a multiple of 32; the module docstring): int8 as
    they are, int4 as int32 words [N, K / 8]. Made a few rows at a time: a 70B model's layers are
    quantized on the GPU that runs them."""
    if bits == 8:
        return codes.contiguous()
    n, k = codes.shape
    words = torch.empty(n, k // 8, dtype=torch.int32, device=codes.device)
    rows = max(1, (1 << 22) // k)
    for start in range(0, n, rows):
        nibbles = codes[start : start + rows].reshape(-1, k // 32, 8, 4).transpose(2, 3)  # [row, block, word, j]
        words[start : start + rows] = words_from_nibbles(nibbles).reshape(-1, k // 8)
    return words


def load_codes(stored: Tensor, bits: int) -> Tensor:
    """Inverse of `store_codes`: codes [N, K] as uint8."""
    if bits == 8:
        return stored
    n, words = stored.shape
    return nibbles_from_words(stored.reshape(n, words // 4, 4)).transpose(2, 3).reshape(n, words * 8)


# How Triton orders a load's dimensions of equal contiguity (`_gemv_scales`): first to last before 3.7.
TRITON_TIES_FIRST = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7)

# 2**23's exponent bits, an argument of `_gemv` (see `_nibble`).
EXPONENT_OF_2_23 = 150 << 23


def sub_block(k: int, group_size: int, cap: int, bits: int) -> tuple[int, int]:
    """A sub-block's groups (GS columns each, one scale) and how many (NG): the widest power of two
    up to `cap` columns that divides K and lies within a group or spans whole groups. int4's are
    read as blocks of 32 columns (a scale each, read per block), the words' unit."""
    sub = cap
    while k % sub or (group_size % sub and sub % group_size):
        sub //= 2
    gs = 32 if bits == 4 else min(sub, group_size)
    return gs, sub // gs


def k_splits(k: int, sub: int, wanted: int) -> tuple[int, int]:
    """K cut into at most `wanted` slices of whole sub-blocks: (slices, columns per slice)."""
    per_split = triton.cdiv(triton.cdiv(k, wanted), sub) * sub
    return triton.cdiv(k, per_split), per_split


def gemv_config(n: int, k: int, bits: int) -> dict[str, int]:
    """Block sizes for one row. What they decide, counted by `benchmarks/triton_sass.py` for sm_90
    (no GPU needed): the loop's instructions per byte of codes (int8 per channel 4.6, int4 7.3-7.7)
    and the bytes it loads per byte of codes, 1 + (x's bytes per code byte) / (rows per thread),
    since a thread loads x once for all the rows it holds: 2.0-2.1 at 4-8 rows per thread, where
    one row per thread (as Triton 3.6 laid out an older 3D tile) loaded 9.1 and streamed far
    slower in a compiled decode step. A row of 1024
    columns is 32 threads of 4 int4 words, so 16 rows over 2 warps put 8 rows in each thread; K
    not a multiple of 1024 (Llama-2-7B's down projection, 11008 = 43 x 256) takes 256-column
    sub-blocks, 8 threads a row, and 64 rows over 2 warps for the same 8, with K split in 4 so that
    its 4096 rows still make 256 programs; int8 there takes 32 rows over 4 warps (2.0 bytes loaded
    per byte, from 3.0 at 16 rows), K split in 2."""
    if bits == 8:
        if k % 512 == 0:  # 512 bytes a row: 32 threads, 4 rows each over 4 warps
            return {"BLOCK_N": 16, "UNROLL": 1, "SUB": 512, "num_warps": 4}
        return {"BLOCK_N": 32, "UNROLL": 1, "SUB": 256, "num_warps": 4, "SPLIT_K": 2}
    if k % 1024 == 0:
        return {"BLOCK_N": 16, "UNROLL": 2, "SUB": 1024, "num_warps": 2}
    return {"BLOCK_N": 64, "UNROLL": 2, "SUB": 256, "num_warps": 2, "SPLIT_K": 4}


def gemv_launch(k: int, bits: int, group_size: int, config: dict[str, int]) -> tuple[dict[str, int], int, int]:
    """The one-row kernel's launch keywords (its constants and num_warps) for a K-wide input from
    `config` (gemv_config's keys, SPLIT_K optional), the slices K is cut into and their width."""
    config = dict(config)
    gs, ng = sub_block(k, group_size, config.pop("SUB"), bits)
    splits, k_split = k_splits(k, gs * ng, config.pop("SPLIT_K", 1))
    lanes = 4 if bits == 4 else gs  # int4: a lane per word
    per_row = group_size >= k
    layout = dict(LANES=lanes, PER_ROW=per_row, TIES_FIRST=TRITON_TIES_FIRST)
    x_sums = int(bool(config.pop("X_SUMS", 0)) and not per_row)  # one minimum per row: added at the end anyway
    constants = dict(BITS=bits, GROUP=group_size, GS=gs, NG=ng, X_SUMS=x_sums, **layout, **config)
    return constants, splits, k_split


def gemm_launch(k: int, bits: int, group_size: int, config: dict[str, int]) -> tuple[dict[str, int], int, int]:
    """The few-row kernel's launch keywords (its constants but IEEE, and num_warps) for a K-wide
    input from `config` (gemm_config's keys, SPLIT_K optional), the slices K is cut into and their
    width."""
    config = dict(config)
    gs, ng = sub_block(k, group_size, config.pop("SUB"), bits)
    splits, k_split = k_splits(k, gs * ng, config.pop("SPLIT_K", 1))
    return dict(BITS=bits, GROUP=group_size, GS=gs, NG=ng, SUB=gs * ng, **config), splits, k_split


# Programs a few-row int4 launch aims for, K split to reach them: two per SM of an H100 (132).
FEW_ROW_PROGRAMS = 256


def gemm_config(m: int, n: int, k: int, bits: int) -> dict[str, int]:
    """Block sizes for a few rows: all of them in one BLOCK_M where possible (the weight is read
    once per BLOCK_M rows). int8: for 8 rows of Llama-2-7B's linears on an H100, 32 output rows of
    128 columns per program were the fastest (benchmarks/cuda_linear.py --sweep). int4, counted by
    `benchmarks/triton_sass.py --kernel few-row` (not yet timed), without spills, Triton 3.6 and
    3.9 alike: up to 16 rows, 32 output rows of 256 columns over 2 warps, 10.9-11.4 instructions
    per byte of codes (4 warps 12.2, 128 columns 12.0-12.3); more rows take more output rows per
    program, so that the loop loads 3.2 bytes per byte of codes at any BLOCK_M (x, which each
    program reloads from L2, ~2.2 of them): 32 rows 64 x 256 over 4 warps (12.3), 64 rows 128 x 128
    over 4 warps (12.3; with 32 output rows 64 rows loaded 9.2). K is split until the launch has
    ~256 programs: a program has only 8-16 KB of codes in flight (two stages of 4-8 KB), where an
    H100 needs ~2 MB in flight to stream."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    if bits == 8:
        return {"BLOCK_M": block_m, "BLOCK_N": 32, "SUB": 128, "num_warps": 4}
    block_n, sub, warps = {16: (32, 256, 2), 32: (64, 256, 4), 64: (128, 128, 4)}[block_m]
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = max(1, min(4, FEW_ROW_PROGRAMS // programs))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "SUB": sub, "num_warps": warps, "SPLIT_K": split}


def qlinear(
    x: Tensor, codes: Tensor, scales: Tensor, mins: Tensor, bits: int, group_size: int, config: dict | None = None
) -> Tensor:
    """x [M, K] (K padded to whole groups; fp32, bf16 or fp16, contiguous) times the quantized
    weight [N, K] transposed, its codes in `store_codes`' form: [M, N] in x's dtype. Meant for few
    rows: a long input re-reads the weight once per 64 rows (QuantLinear sends those to cuBLAS)."""
    m, k = x.shape
    n = codes.shape[0]
    if m == 1:
        constants, splits, k_split = gemv_launch(k, bits, group_size, config or gemv_config(n, k, bits))
        out = _split_output(splits, m, n, x)
        grid = (triton.cdiv(n, constants["BLOCK_N"]), splits)
        x32 = x.float()
        x_sums = x32.view(-1, constants["GS"]).sum(1) if constants["X_SUMS"] else x32  # (else unread)
        wrap_triton(_gemv)[grid](x32, codes, scales, mins, x_sums, out, n, k, k_split, codes.stride(0),
                                 scales.stride(0), EXPONENT_OF_2_23, **constants)  # fmt: skip
    else:
        if not few_rows_take(k, bits):
            raise ValueError(f"the few-row int4 kernel needs K a multiple of 128, not {k}")
        constants, splits, k_split = gemm_launch(k, bits, group_size, config or gemm_config(m, n, k, bits))
        out = _split_output(splits, m, n, x)
        grid = (triton.cdiv(n, constants["BLOCK_N"]), triton.cdiv(m, constants["BLOCK_M"]), splits)
        wrap_triton(_gemm)[grid](x, codes, scales, mins, out, m, n, k, k_split, x.stride(0), n, codes.stride(0),
                                 scales.stride(0), EXPONENT_OF_2_23, IEEE=x.dtype == torch.float32,
                                 **constants)  # fmt: skip
    if splits == 1:
        return out[0]
    total = out[0]
    for j in range(1, splits):  # one add after another: eager and inductor's fused kernel add alike
        total = total + out[j]
    return total.to(x.dtype)


def few_rows_take(k: int, bits: int) -> bool:
    """Whether the few-row kernel takes a K-wide input: int4's products per nibble span a quarter
    of a sub-block, and tl.dot needs 16 columns."""
    return bits == 8 or k % 128 == 0


def _split_output(splits: int, m: int, n: int, x: Tensor) -> Tensor:
    """The kernels' output [splits, M, N]: x's dtype for one split; for several, fp32 partial sums,
    added afterwards in a fixed order (no atomics: the same bits every run)."""
    return torch.empty(splits, m, n, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)


@torch.library.triton_op("genfast::qlinear_triton", mutates_args=())
def qlinear_op(x: Tensor, codes: Tensor, scales: Tensor, mins: Tensor, bits: int, group_size: int) -> Tensor:
    """`qlinear` as an op whose kernels torch.compile sees: inductor traces into it and generates
    the launches into its own code (captured with the rest of a CUDA graph), where an opaque
    custom op would be called through the dispatcher and Triton's Python launcher."""
    return qlinear(x, codes, scales, mins, bits, group_size)
