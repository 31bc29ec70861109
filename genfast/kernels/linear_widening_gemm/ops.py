"""`torch.ops.genfast.linear_widening_gemm`: F.linear for fp32 rows, any number of them, and a bf16
weight, which the GEMM widens to fp32 while packing it (avx2.cpp). `portable` upcasts the whole
weight for aten's GEMM instead.

AVX2 only: it serves fp32 compute over bf16-stored weights, which `--dtype auto` picks where the
CPU has no native bf16; an AVX-512 CPU without BF16 (Skylake-X to Ice Lake) runs this variant too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from genfast.kernels.native import Kernel, Variant

KERNEL = Kernel("linear_widening_gemm", "bf16-weight GEMM kernel", (Variant("avx2"),), rank=2)

torch.library.define("genfast::linear_widening_gemm", "(Tensor x, Tensor weight) -> Tensor")


@torch.library.register_fake("genfast::linear_widening_gemm")
def _linear_widening_gemm_fake(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.compiler.assume_constant_result  # run (and build the kernel) while tracing, not traced
def kernel_available() -> bool:
    return KERNEL.unavailable_reason() is None


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether the GEMM takes x times `weight`: fp32 rows on a CPU, a bf16 weight."""
    return weight.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.device.type == "cpu" and kernel_available()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear by the GEMM where `applies`."""
    out = torch.ops.genfast.linear_widening_gemm(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def portable(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The same product in PyTorch: the weight upcast to x's dtype, then aten's GEMM."""
    return F.linear(x, weight.to(x.dtype), bias)
