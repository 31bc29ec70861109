"""Layers shared by all workloads."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from genfast import native

FEW_ROWS_SOURCE = Path(__file__).with_name("linear_few_rows_avx512.cpp")
FEW_ROWS_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
FEW_ROWS_CFLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
# Up to this many rows the kernel beats aten's GEMM on a 2-core Zen 4 (SmolLM2 step, ms: 2 rows 6.4
# vs 12.1, 3: 7.7 vs 11.7, 5: 10.3 vs 12.6); from 6 rows on its bf16 dot products are the bound and
# it only ties (`python benchmarks/linear_kernels.py --rows 1,2,3,4,5,6,8`).
MAX_FEW_ROWS = 5

torch.library.define("genfast::linear_few_rows", "(Tensor x, Tensor weight) -> Tensor")


@torch.library.register_fake("genfast::linear_few_rows")
def _linear_few_rows_fake(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def few_rows_unavailable_reason() -> str | None:
    """Why the few-row bf16 kernel cannot run here, or None when it is loaded."""
    return native.build("linear_few_rows", FEW_ROWS_SOURCE, FEW_ROWS_CFLAGS, FEW_ROWS_CPU_FLAGS,
                        "few-row bf16 linear kernel")


def row_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, scales: Tensor | None = None) -> Tensor:
    """F.linear for inputs with a single row, written as a broadcast multiply-sum in fp32.

    Compiled by inductor this becomes one vectorized reduction that streams the weight at the
    machine's full read bandwidth (measured on a 2-core Zen 4, bf16 SmolLM2 decode shapes:
    48 GB/s, against 18 GB/s for aten::mm and 33 GB/s for a pre-packed oneDNN linear), and it
    fuses with the neighbouring element-wise ops. Eagerly it would materialize an N x K product,
    so `Linear` only takes this path under torch.compile. `scales` (per output channel) serves
    quantized weights: the weight is upcast inside the same loop.
    """
    out = (x.float().reshape(1, -1) * weight.float()).sum(dim=-1)
    if scales is not None:
        out = out * scales.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def few_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear for 2 to MAX_FEW_ROWS bf16 rows by the native kernel, which reads the weight once
    for all rows (aten's GEMM streams it at under half the bandwidth). fp32 sums, as row_linear."""
    out = torch.ops.genfast.linear_few_rows(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _few_rows_apply(x: Tensor, weight: Tensor) -> bool:
    rows = x.numel() // x.shape[-1]
    # A dynamic row count (a prefill's length) keeps aten's GEMM: testing it would add a guard.
    return (statically_known_true(rows >= 2) and statically_known_true(rows <= MAX_FEW_ROWS)
            and x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and weight.shape[1] % 32 == 0 and few_rows_kernel_available())


@torch.compiler.assume_constant_result  # run (and build the kernel) while tracing, not traced
def few_rows_kernel_available() -> bool:
    return few_rows_unavailable_reason() is None


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) with bandwidth-bound paths for one and a few
    input rows under torch.compile (decode, batched decode, speculative verification)."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            if x.numel() == x.shape[-1]:
                return row_linear(x, self.weight, self.bias)
            if _few_rows_apply(x, self.weight):
                return few_rows_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
