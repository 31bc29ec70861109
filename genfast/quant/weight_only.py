"""Weight-only int8 quantization of linear layers (symmetric, one scale per output channel).

Shared by every workload: `quantize_linears_int8(model, filter)` swaps `nn.Linear` modules for
`Int8Linear`. Activations stay in their dtype; only weights are stored in 8 bits.

Kernels, by input shape:
- one row under torch.compile (batch-1 decode): `x * W` upcast and summed in fp32, then scaled,
  which inductor compiles into one loop streaming the int8 weight (half the bytes of bf16);
- eager on CPU: `torch._weight_int8pack_mm` (bf16/fp32 activations, in_features a multiple of
  16); otherwise a dequantize-and-matmul (compiled: inductor fuses the dequantization).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.nn import row_linear

# Accuracy budget (enforced in tests on tiny models): per-weight error <= scale / 2, i.e. at most
# 1/254 of the row's largest magnitude.
INT8_MAX = 127


def quantize_int8_per_channel(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 weight [N, K], fp32 scales [N]) with weight ≈ q * scale[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
    q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T + bias, with q int8 [N, K] and scale [N]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        # fp32 scales: bf16 would add up to 0.4% error per row on top of the rounding.
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        w = linear.weight
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        q, scales = quantize_int8_per_channel(w)
        module.weight.copy_(q)
        module.scales.copy_(scales)
        if linear.bias is not None:
            module.bias.copy_(linear.bias)
        return module

    def dequantize(self) -> Tensor:
        return self.weight.float() * self.scales[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.numel() == x.shape[-1]:
            return row_linear(x, self.weight, self.bias, self.scales)
        if (not torch.compiler.is_compiling() and x.device.type == "cpu"
                and x.dtype in (torch.bfloat16, torch.float32) and self.in_features % 16 == 0):
            # Eager only: inductor (torch 2.13) fails to lower this op on a fused input. And its
            # CPU kernel crashes (segfault) for bf16 inputs of several rows when in_features is
            # not a multiple of 16; such layers take the fallback below.
            rows = x.reshape(-1, self.in_features)
            out = torch._weight_int8pack_mm(rows, self.weight, self.scales.to(x.dtype))
            out = out.reshape(*x.shape[:-1], self.out_features)
        else:
            # Scales go into the weight, not the output: inductor rewrites `linear(x, w) * s`
            # into _weight_int8pack_mm, whose lowering fails on fused inputs (torch 2.13).
            out = F.linear(x, self.weight.to(x.dtype) * self.scales[:, None].to(x.dtype))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


LinearFilter = Callable[[str, nn.Linear], bool]


def quantize_linears_int8(model: nn.Module, keep: LinearFilter | None = None) -> int:
    """Replace every nn.Linear for which `keep(name, module)` is not True by an Int8Linear.

    Returns how many layers were quantized. Tied weights are untied for the quantized copy (the
    embedding lookup keeps its floating-point table).
    """
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not (keep and keep(name, m))]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Int8Linear.from_linear(linear))
    return len(targets)
