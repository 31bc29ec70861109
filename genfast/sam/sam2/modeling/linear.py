"""The linear layers of SAM 2's image encoder: one oneDNN matrix product with the bias (and a
following GELU) applied in its epilogue, on the CPU.

aten.addmm, which nn.Linear is on the CPU, first copies the bias into every row of its output and
then accumulates the product onto it: a slow extra pass over outputs that are large at the 1/4
scale (65536 x 576 for a pooling block's qkv). In the compiled encoder inductor cannot fuse
either the bias or the MLP's GELU into aten's product. oneDNN's linear takes both as post-ops
of its own kernel (`torch.ops.mkldnn._linear_pointwise`, here with the plain weight, which it
reorders per call: a small cost next to these products). On sam2.1-hiera-tiny's shapes (bf16, one
Zen 4 thread) addmm took 10-20% longer than the fused product, and the GELU was a pass of its own.

`dense_linear` is a custom op, so that a compiled encoder calls it as one kernel (inductor's own
lowering of the oneDNN op wants prepacked constant weights; these weights are graph inputs).
Elsewhere (no oneDNN, another device or dtype, bf16 without native bf16 arithmetic, where oneDNN
has no bf16 linear under an AVX2 cap, gradients wanted) it is F.linear (+ F.gelu). Where the CPU
has bf16 instructions that are slower than its fp32 FMAs (`hardware.fast_bf16_products`), a bf16
layer multiplies in fp32.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.platform import hardware
from genfast.quant.linear import QuantLinear

ACTIVATIONS = ("none", "gelu")  # GELU: the exact (erf) one, as nn.GELU()


@cache
def _fused_dtypes() -> frozenset[torch.dtype]:
    """The dtypes oneDNN's linear computes here: x86 CPUs (AVX2 and up) with fp32, and bf16 where
    the CPU has bf16 arithmetic (the ISA caps of scripts/with_isa.sh apply)."""
    if not (torch.backends.mkldnn.is_available() and hardware.isa_allows("avx2")):
        return frozenset()
    return frozenset({torch.float32, torch.bfloat16} if hardware.has_native_bf16() else {torch.float32})


def _fused(x: Tensor, weight: Tensor) -> bool:
    """Whether oneDNN's linear takes these operands."""
    return x.device.type == "cpu" and x.dtype in _fused_dtypes() and weight.dtype == x.dtype


def _reference(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    out = F.linear(x, weight, bias)
    return F.gelu(out) if activation == "gelu" else out


@torch.library.custom_op("genfast::dense_linear", mutates_args=())
def dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """activation(x @ weight^T + bias) for x [..., K], weight [N, K]: [..., N]."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; one of {', '.join(ACTIVATIONS)}")
    if not _fused(x, weight):
        return _reference(x, weight, bias, activation)
    rows = x.reshape(-1, x.shape[-1])
    algorithm = "none" if activation == "gelu" else ""  # oneDNN's erf GELU
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, activation, [], algorithm)
    return out.view(*x.shape[:-1], weight.shape[0])


@dense_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _cpu_ops_apply(*tensors: Tensor | None) -> bool:
    """Whether this file's custom ops take these operands: CPU tensors with no gradient wanted
    (the ops have no backward). Elsewhere a compiler fuses the plain ops (CUDA's matrix products
    take the bias and the GELU as epilogues)."""
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    return tensors[0].device.type == "cpu" and not wants_grad


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str = "none") -> Tensor:
    """dense_linear on the CPU; F.linear (+ GELU) elsewhere and where gradients are wanted
    (`_cpu_ops_apply`). bf16 operands are multiplied in fp32 where bf16 products are the slower
    (`hardware.fast_bf16_products`); the result is bf16 again. The casts stay outside the custom
    op, so that in a compiled graph inductor can fuse them with neighbouring elementwise work."""
    if not _cpu_ops_apply(x, weight, bias):
        return _reference(x, weight, bias, activation)
    if x.dtype == torch.bfloat16 and not hardware.fast_bf16_products():
        wide = (t if t is None else t.float() for t in (x, weight, bias))
        return dense_linear(*wide, activation).to(x.dtype)
    return dense_linear(x, weight, bias, activation)


class Linear(nn.Linear):
    """nn.Linear computed by `linear` (dynamic int8 replaces it as any nn.Linear)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


@torch.library.custom_op("genfast::aten_gelu", mutates_args=())
def aten_gelu(x: Tensor) -> Tensor:
    """ATen's exact (erf) GELU, as one opaque op. In a compiled encoder the GELU after an int8
    linear (genfast's kernel, opaque too) has nothing to fuse with, and inductor's own erf GELU
    was slower than ATen's on its shapes (bf16, [4096, 1536] and [1024, 3072]; docs/notes.md)."""
    return F.gelu(x)


@aten_gelu.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def linear_gelu(layer: nn.Module, x: Tensor) -> Tensor:
    """GELU(layer(x)): fused where the layer is a floating-point Linear (oneDNN's epilogue) or a
    dynamic-int8 one (genfast's kernel's epilogue, where it runs: QuantLinear); ATen's GELU after
    any other layer on the CPU (`aten_gelu`)."""
    if type(layer) is Linear:
        return linear(x, layer.weight, layer.bias, "gelu")
    if isinstance(layer, QuantLinear):
        return layer(x, activation="gelu")
    out = layer(x)
    return aten_gelu(out) if _cpu_ops_apply(out) else F.gelu(out)
