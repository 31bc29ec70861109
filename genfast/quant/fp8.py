"""Dynamic fp8: float8 (e4m3) activations x float8 weights, each row of the activations and each
output channel of the weight with its own scale, multiplied by `torch._scaled_mm`: on GPUs with
fp8 tensor cores (compute capability 8.9 and up: Ada, Hopper, Blackwell) twice bf16's rate, the
quantization flux-fast applies to FLUX.1's linears.

A value is stored as `code * scale`, the scale of a row its largest magnitude over e4m3's largest
finite value (448), so that every row uses the whole range. e4m3 keeps 3 mantissa bits: each code
is within 2^-4 of its value relatively, and the errors of a dot product's terms average out.

torch's CPU build has `_scaled_mm` too (the tests run the layer on a CPU), but without fp8
arithmetic: there it is no faster than the floating-point linear, and the recipe's step asks
for a GPU (`unavailable_reason`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from genfast.quant.linear import LinearFilter, replace_linears

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# cuBLAS's fp8 GEMM takes K and N in multiples of 16; other layers stay in floating point.
MULTIPLE = 16
MIN_CAPABILITY = (8, 9)


def unavailable_reason(device: torch.device) -> str | None:
    """Why fp8 products cannot run on `device`, or None."""
    if device.type != "cuda":
        return (
            f"fp8 products need a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer "
            f"(Ada, Hopper); this is a {device.type}"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (
            f"fp8 products need compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
        )
    return None


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """fp8 codes of a 2-D tensor and one fp32 scale per row ([rows, 1]): x ~ codes * scale."""
    wide = x.float()
    scale = wide.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (wide / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8DynamicLinear(nn.Module):
    """y = x @ W^T + b with x quantized to fp8 per row on every call and W per output channel once;
    the product accumulates in fp32 and is rounded once to x's dtype (bf16 on a GPU: the dtype
    `_scaled_mm` writes with per-row scales)."""

    def __init__(self, codes: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight_codes", codes)  # [N, K] fp8: its transpose is column-major, as cuBLAS wants
        self.register_buffer("weight_scale", scale.reshape(1, -1))  # [1, N] fp32
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8DynamicLinear:
        codes, scale = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        return cls(codes, scale, bias)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        codes, scale = quantize_rows(rows)
        out = torch._scaled_mm(
            codes,
            self.weight_codes.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=torch.bfloat16,
        )
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 (e4m3) dynamic"


def fits(linear: nn.Linear) -> bool:
    """Whether cuBLAS's fp8 GEMM takes the layer's shape."""
    return linear.in_features % MULTIPLE == 0 and linear.out_features % MULTIPLE == 0


def quantize_dynamic_fp8(model: nn.Module, keep: LinearFilter | None = None) -> list[str]:
    """Dynamic fp8 for the linears that `keep(name, linear)` does not claim and cuBLAS's fp8 GEMM
    takes (`fits`); returns the names replaced."""

    def kept(name: str, linear: nn.Module) -> bool:
        return not isinstance(linear, nn.Linear) or not fits(linear) or bool(keep and keep(name, linear))

    return replace_linears(model, lambda _, linear: Fp8DynamicLinear.from_linear(linear), kept)
