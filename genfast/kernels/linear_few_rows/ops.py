"""`torch.ops.genfast.linear_few_rows`: F.linear for fp32 or bf16 rows and a bf16 weight, summing in
fp32. It reads the weight once for all rows, which makes it the fastest for 1 to MAX_FEW_ROWS rows
(decode, batched decode, verification): there genfast.nn.Linear takes it under torch.compile
(elsewhere aten's F.linear, or compiled its one-row reduction). It takes any row count, and sums
each output in one order whatever the row count and the thread count: batch-invariant mode
(genfast/llm/model/invariance.py) runs every row count through it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from genfast.kernels.native import Kernel, Variant

KERNEL = Kernel(
    "linear_few_rows",
    "few-row bf16 linear kernel",
    (Variant("avx512", ("avx512_bf16",), ("-mavx512bf16",)), Variant("avx2")),
    rank=1,
)

# Up to this many rows the AVX-512 variant beats aten's GEMM; from 6 rows on its bf16 dot products
# are the bound and it only ties (`python benchmarks/linear_kernels.py --rows 1,2,3,4,5,6,8`
# compares them). The AVX2 variant uses the same bound.
MAX_FEW_ROWS = 5
K_MULTIPLE = 32  # the in-features the variants take: whole 32-column chunks

torch.library.define("genfast::linear_few_rows", "(Tensor x, Tensor weight) -> Tensor")


@torch.library.register_fake("genfast::linear_few_rows")
def _linear_few_rows_fake(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def unavailable_reason() -> str | None:
    """Why the few-row bf16 kernel cannot run here, or None when it is loaded."""
    return KERNEL.unavailable_reason()


@torch.compiler.assume_constant_result  # run (and build the kernel) while tracing, not traced
def kernel_available() -> bool:
    return unavailable_reason() is None


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernel takes x [..., K] times `weight` [N, K]: a bf16 weight, fp32 or bf16 rows
    on a CPU, K a multiple of 32, 1 to MAX_FEW_ROWS rows known while tracing."""
    rows = x.numel() // x.shape[-1]
    # A dynamic row count (a prefill's length) goes to a GEMM: testing it would add a guard.
    return (
        weight.dtype == torch.bfloat16
        and x.dtype in (torch.bfloat16, torch.float32)
        and x.device.type == "cpu"
        and weight.shape[1] % K_MULTIPLE == 0
        and kernel_available()
        and statically_known_true(rows >= 1)
        and statically_known_true(rows <= MAX_FEW_ROWS)
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear by the kernel where `applies`: fp32 sums, the result in x's dtype."""
    out = torch.ops.genfast.linear_few_rows(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
