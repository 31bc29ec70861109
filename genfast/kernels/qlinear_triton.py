"""Weight-only int8/int4 linear on CUDA: Triton kernels over genfast's storage form of the codes.

Decode at batch 1 is a matrix-vector product that must stream the weight at the memory's rate.
torch's own CUDA kernels do not for these formats (benchmarks/cuda_linear.py on an H100:
`_weight_int8pack_mm` ~100 GB/s; tinygemm's int4 at groups of 32 ~800 GB/s against cuBLAS bf16's
~1.8 TB/s), so the codes are read here directly, in the form `genfast.quant.grids` stores them:

    w[n, k] = u[n, k] * scale[n, g] + min[n, g],   g = k // group_size

with u one byte each (int8) or two per byte, even column in the low nibble (int4), and scales and
minima fp16 [N, K // group_size]. Two kernels:

- `_gemv`: one row. Each program owns BLOCK_N output rows and walks K in sub-blocks of SUB columns
  (NG groups of GS columns, a scale and minimum each, held as a third tile dimension so a small
  group never shrinks the loads); the products accumulate element-wise in fp32 and
  are summed once at the end, so the loop is loads and fused multiply-adds only. Codes become floats
  through the exponent trick (the byte OR-ed into 2^23's bits, minus 2^23), two full-rate ops
  instead of a quarter-rate integer conversion. With one scale per row (int8's default) the loop
  multiplies the codes alone and the scale and minimum are applied once per row at the end
  (s sum u x + m sum x). The loop is bound by instruction issue before memory on an H100 (its 132
  SMs issue 128 thread-instructions per cycle each; streaming 3 TB/s needs ~12 bytes of codes per
  SM and cycle), so what counts is instructions per byte of codes: `benchmarks/triton_sass.py`
  compiles the kernel for sm_90 without a GPU and counts them.
- `_gemm`: a few rows (speculative verification, a serving batch, short prefills):
  each sub-block is dequantized to the activations' dtype in registers and multiplied with tl.dot,
  so the weight is still read once per BLOCK_M rows.

Longer inputs (prefill) are compute-bound: the caller dequantizes and uses cuBLAS.
The summation order is fixed by the configuration: along K by SUB (and, for one row, SPLIT_K: K cut
into that many slices, one program each, whose fp32 partial sums are added in order afterwards, for
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


@triton.jit
def _as_float(u):
    """Small non-negative int32 -> fp32, exactly, without the integer-to-float conversion unit:
    OR-ed into the bits of 2.0**23 (0x4B000000) an integer u < 2**23 gives the float 2**23 + u."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _sub_block_grid(scales_ptr, mins_ptr, rows, row_ok, k, stride_grid, GROUP: tl.constexpr, GS: tl.constexpr,
                    NG: tl.constexpr):  # fmt: skip
    """The scales and minima of a sub-block's NG groups of GS columns, [BLOCK_N, NG, 1] in fp32."""
    grid = rows[:, None] * stride_grid + ((k + tl.arange(0, NG) * GS) // GROUP)[None, :]
    scale = tl.load(scales_ptr + grid, mask=row_ok[:, None], other=0.0).to(tl.float32)
    low = tl.load(mins_ptr + grid, mask=row_ok[:, None], other=0.0).to(tl.float32)
    return scale[:, :, None], low[:, :, None]


@triton.jit
def _gemv_sub(acc, x_ptr, codes_ptr, scales_ptr, mins_ptr, rows, row_ok, k, stride_codes, stride_grid,
              BITS: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr,
              LANES: tl.constexpr, PER_ROW: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, NG, LANES] += one sub-block's products: NG groups of GS columns from column k
    (LANES: GS bytes of int8 codes, GS / 2 of int4). PER_ROW (one scale and minimum per row): the
    codes' products alone, scaled once at the end."""
    group = tl.arange(0, NG)[None, :, None]
    lane = tl.arange(0, LANES)[None, None, :]
    row_codes = codes_ptr + rows[:, None, None] * stride_codes
    # x is read through a [BLOCK_N, ...] tile of equal rows, so that it gets the codes' layout: read
    # as one row, Triton gives it a layout of its own and moves the codes (or x) through shared
    # memory at every step (benchmarks/triton_sass.py counts the instructions).
    x_rows = x_ptr + tl.zeros_like(rows)[:, None, None]
    if BITS == 4:  # a lane per byte: columns 2j (low nibble) and 2j + 1
        b = tl.load(row_codes + (k // 2 + group * LANES + lane), mask=row_ok[:, None, None], other=0).to(tl.int32)
        column = k + group * GS + 2 * lane
        x_even = tl.load(x_rows + column).to(tl.float32)
        x_odd = tl.load(x_rows + column + 1).to(tl.float32)
        codes_dot = _as_float(b & 0xF) * x_even + _as_float(b >> 4) * x_odd
        if PER_ROW:
            acc += codes_dot
        else:  # (u0 s + m) x0 + (u1 s + m) x1 = s (u0 x0 + u1 x1) + m (x0 + x1)
            scale, low = _sub_block_grid(scales_ptr, mins_ptr, rows, row_ok, k, stride_grid, GROUP, GS, NG)
            acc += scale * codes_dot + low * (x_even + x_odd)
    else:
        column = tl.max_contiguous(tl.multiple_of(k + group * GS + lane, [1, 1, LANES]), [1, 1, LANES])
        u = _as_float(tl.load(row_codes + column, mask=row_ok[:, None, None], other=0).to(tl.int32))
        x = tl.load(x_rows + column).to(tl.float32)
        if PER_ROW:
            acc += u * x
        else:
            scale, low = _sub_block_grid(scales_ptr, mins_ptr, rows, row_ok, k, stride_grid, GROUP, GS, NG)
            acc += scale * (u * x) + low * x
    return acc


@triton.jit
def _gemv(x_ptr, codes_ptr, scales_ptr, mins_ptr, out_ptr, N, K, K_SPLIT, stride_codes, stride_grid,
          BITS: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr, LANES: tl.constexpr,
          BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, PER_ROW: tl.constexpr):  # fmt: skip
    """Program (i, j): rows i * BLOCK_N.., columns j * K_SPLIT.. up to K_SPLIT of them, its sum
    stored to out[j] (one split: the output itself; several: fp32 partial sums)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.zeros([BLOCK_N, NG, LANES], dtype=tl.float32)
    sub = GS * NG
    block_k = sub * UNROLL
    begin = tl.program_id(1) * K_SPLIT
    end = tl.minimum(begin + K_SPLIT, K)
    whole = end - (end - begin) % block_k
    for k0 in range(begin, whole, block_k):
        for j in tl.static_range(UNROLL):
            acc = _gemv_sub(acc, x_ptr, codes_ptr, scales_ptr, mins_ptr, rows, row_ok, k0 + j * sub, stride_codes,
                            stride_grid, BITS, GROUP, GS, NG, LANES, PER_ROW)  # fmt: skip
    for k in range(whole, end, sub):
        acc = _gemv_sub(acc, x_ptr, codes_ptr, scales_ptr, mins_ptr, rows, row_ok, k, stride_codes, stride_grid,
                        BITS, GROUP, GS, NG, LANES, PER_ROW)  # fmt: skip
    total = tl.sum(tl.sum(acc, axis=2), axis=1)
    if PER_ROW:  # sum_k (u s + m) x_k = s sum_k u x_k + m sum_k x_k, over this program's columns
        x_sum = tl.zeros([GS * NG], dtype=tl.float32)
        for k in range(begin, end, sub):
            x_sum += tl.load(x_ptr + k + tl.arange(0, GS * NG)).to(tl.float32)
        scale = tl.load(scales_ptr + rows * stride_grid, mask=row_ok, other=0.0).to(tl.float32)
        low = tl.load(mins_ptr + rows * stride_grid, mask=row_ok, other=0.0).to(tl.float32)
        total = scale * total + low * tl.sum(x_sum, axis=0)
    out = out_ptr + tl.program_id(1) * N + rows
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemm(x_ptr, codes_ptr, scales_ptr, mins_ptr, out_ptr, M, N, K, stride_x, stride_out, stride_codes,
          stride_grid, BITS: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr,
          SUB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    token_ok = tokens < M
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    group = tl.arange(0, NG)[None, :, None]
    row_codes = codes_ptr + rows[:, None, None] * stride_codes
    x_rows = x_ptr + tokens[:, None] * stride_x
    for k in range(0, K, SUB):
        scale, low = _sub_block_grid(scales_ptr, mins_ptr, rows, row_ok, k, stride_grid, GROUP, GS, NG)
        if BITS == 4:  # the even and the odd columns as two products of half the width
            lane = tl.arange(0, GS // 2)[None, None, :]
            b = tl.load(row_codes + (k // 2 + group * (GS // 2) + lane), mask=row_ok[:, None, None], other=0)
            b = b.to(tl.int32)
            w_even = tl.reshape((_as_float(b & 0xF) * scale + low).to(dtype), [BLOCK_N, SUB // 2])
            w_odd = tl.reshape((_as_float(b >> 4) * scale + low).to(dtype), [BLOCK_N, SUB // 2])
            column = k + 2 * tl.arange(0, SUB // 2)[None, :]
            x_even = tl.load(x_rows + column, mask=token_ok[:, None], other=0.0)
            x_odd = tl.load(x_rows + column + 1, mask=token_ok[:, None], other=0.0)
            if IEEE:
                acc += tl.dot(x_even, tl.trans(w_even), input_precision="ieee")
                acc += tl.dot(x_odd, tl.trans(w_odd), input_precision="ieee")
            else:
                acc += tl.dot(x_even, tl.trans(w_even))
                acc += tl.dot(x_odd, tl.trans(w_odd))
        else:
            lane = tl.arange(0, GS)[None, None, :]
            u = tl.load(row_codes + (k + group * GS + lane), mask=row_ok[:, None, None], other=0)
            w = tl.reshape((_as_float(u.to(tl.int32)) * scale + low).to(dtype), [BLOCK_N, SUB])
            x = tl.load(x_rows + k + tl.arange(0, SUB)[None, :], mask=token_ok[:, None], other=0.0)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
    out = out_ptr + tokens[:, None] * stride_out + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=token_ok[:, None] & row_ok[None, :])


def sub_block(k: int, group_size: int, cap: int) -> tuple[int, int]:
    """A sub-block's groups (GS columns each, one scale) and how many (NG): the widest power of two
    up to `cap` columns that divides K and lies within a group or spans whole groups."""
    sub = cap
    while k % sub or (group_size % sub and sub % group_size):
        sub //= 2
    gs = min(sub, group_size)
    return gs, sub // gs


def k_splits(k: int, sub: int, wanted: int) -> tuple[int, int]:
    """K cut into at most `wanted` slices of whole sub-blocks: (slices, columns per slice)."""
    per_split = triton.cdiv(triton.cdiv(k, wanted), sub) * sub
    return triton.cdiv(k, per_split), per_split


def gemv_config(n: int, k: int, bits: int) -> dict[str, int]:
    """Block sizes for one row, 16 output rows per program. Chosen by the loop's instructions per
    byte of codes, counted by `benchmarks/triton_sass.py` for sm_90 with Triton 3.6 (torch 2.11's,
    the one the H100 ran): int8 per channel 4.9 at one 512-column sub-block per step and 4 warps
    (18.8 for the previous kernel at its swept best, 8 rows, which streamed 1.65 TB/s in a decode
    step on an H100, ~93% of what issuing 18.8 instructions per byte allows); int4 in groups of 32
    23.0 at two 512-column sub-blocks per step and 8 warps (26.2 before: ~1.05 TB/s). Not yet timed
    on a GPU: `benchmarks/cuda_linear.py --sweep` times these against the other configurations."""
    if bits == 8:
        return {"BLOCK_N": 16, "UNROLL": 1, "SUB": 512, "num_warps": 4}
    return {"BLOCK_N": 16, "UNROLL": 2, "SUB": 512, "num_warps": 8}


def gemv_launch(k: int, bits: int, group_size: int, config: dict[str, int]) -> tuple[dict[str, int], int, int]:
    """The one-row kernel's launch keywords (its constants and num_warps) for a K-wide input from
    `config` (gemv_config's keys, SPLIT_K optional), the slices K is cut into and their width."""
    config = dict(config)
    gs, ng = sub_block(k, group_size, config.pop("SUB"))
    splits, k_split = k_splits(k, gs * ng, config.pop("SPLIT_K", 1))
    lanes = gs // 2 if bits == 4 else gs
    constants = dict(BITS=bits, GROUP=group_size, GS=gs, NG=ng, LANES=lanes, PER_ROW=group_size >= k, **config)
    return constants, splits, k_split


def gemm_config(m: int, n: int, k: int, bits: int) -> dict[str, int]:
    """Block sizes for a few rows: all of them in one BLOCK_M where possible (the weight is read
    once per BLOCK_M rows); for 8 rows of Llama-2-7B's int8 linears on an H100, 32 output rows of
    128 columns per program were the fastest (benchmarks/cuda_linear.py --sweep)."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    return {"BLOCK_M": block_m, "BLOCK_N": 32 if bits == 8 else 64, "SUB": 128, "num_warps": 4}


def qlinear(
    x: Tensor, codes: Tensor, scales: Tensor, mins: Tensor, bits: int, group_size: int, config: dict | None = None
) -> Tensor:
    """x [M, K] (K padded to whole groups; fp32, bf16 or fp16, contiguous) times the quantized
    weight [N, K] transposed: [M, N] in x's dtype. Meant for few rows: a long input re-reads the
    weight once per 64 rows (QuantLinear sends those to cuBLAS)."""
    m, k = x.shape
    n = codes.shape[0]
    if m == 1:
        constants, splits, k_split = gemv_launch(k, bits, group_size, config or gemv_config(n, k, bits))
        # Several splits of K: fp32 partial sums, added in a fixed order (no atomics: the same bits every run).
        out = torch.empty(splits, n, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
        grid = (triton.cdiv(n, constants["BLOCK_N"]), splits)
        wrap_triton(_gemv)[grid](x, codes, scales, mins, out, n, k, k_split, codes.stride(0), scales.stride(0),
                                 **constants)  # fmt: skip
        if splits == 1:
            return out
        total = out[0:1]
        for j in range(1, splits):  # one add after another: eager and inductor's fused kernel add alike
            total = total + out[j : j + 1]
        return total.to(x.dtype)
    config = dict(config or gemm_config(m, n, k, bits))
    gs, ng = sub_block(k, group_size, config.pop("SUB"))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, config["BLOCK_N"]), triton.cdiv(m, config["BLOCK_M"]))
    wrap_triton(_gemm)[grid](x, codes, scales, mins, out, m, n, k, x.stride(0), out.stride(0), codes.stride(0),
                             scales.stride(0), BITS=bits, GROUP=group_size, GS=gs, NG=ng, SUB=gs * ng,
                             IEEE=x.dtype == torch.float32, **config)  # fmt: skip
    return out


@torch.library.triton_op("genfast::qlinear_triton", mutates_args=())
def qlinear_op(x: Tensor, codes: Tensor, scales: Tensor, mins: Tensor, bits: int, group_size: int) -> Tensor:
    """`qlinear` as an op whose kernels torch.compile sees: inductor traces into it and generates
    the launches into its own code (captured with the rest of a CUDA graph), where an opaque
    custom op would be called through the dispatcher and Triton's Python launcher."""
    return qlinear(x, codes, scales, mins, bits, group_size)
