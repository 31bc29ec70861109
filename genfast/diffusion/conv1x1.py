"""1x1 convolutions as linears over the channel dimension.

A 1x1 Conv2d (stride 1, no padding, no groups) is a matmul of every pixel's channel vector by the
weight matrix. As an `nn.Linear` it runs as one GEMM on a channels_last tensor (a free permute)
and, being a Linear, it is also picked up by dynamic int8 quantization. The same weights and bias
are used, so the swap is exact up to fp32 summation order, and `linears_to_conv1x1` undoes it.
diffusers' UNets have them as resnet shortcuts and (SD 1.5) transformer projections; the VAE as
quant/post-quant convs and shortcuts.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def is_pointwise_conv(module: nn.Module) -> bool:
    """True for the Conv2d layers that are exactly a per-pixel matmul."""
    return (
        isinstance(module, nn.Conv2d)
        and module.kernel_size == (1, 1)
        and module.stride == (1, 1)
        and module.padding == (0, 0)
        and module.dilation == (1, 1)
        and module.groups == 1
    )


class Conv1x1AsLinear(nn.Module):
    """A 1x1 Conv2d computed as `linear` over channels: NCHW in, NCHW (channels_last strides) out."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> Conv1x1AsLinear:
        weight = conv.weight
        linear = nn.Linear(
            conv.in_channels, conv.out_channels, bias=conv.bias is not None, device=weight.device, dtype=weight.dtype
        )
        with torch.no_grad():
            linear.weight.copy_(weight.reshape(conv.out_channels, conv.in_channels))
            if conv.bias is not None:
                linear.bias.copy_(conv.bias)
        return cls(linear)

    def to_conv(self) -> nn.Conv2d:
        linear = self.linear
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"cannot turn {type(linear).__name__} back into a convolution (quantized?)")
        conv = nn.Conv2d(
            linear.in_features,
            linear.out_features,
            1,
            bias=linear.bias is not None,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        with torch.no_grad():
            conv.weight.copy_(linear.weight.reshape(conv.weight.shape))
            if linear.bias is not None:
                conv.bias.copy_(linear.bias)
        return conv

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def conv1x1_to_linear(model: nn.Module) -> list[str]:
    """Replace every pointwise Conv2d of `model` by a Conv1x1AsLinear, in place; returns their names."""
    names = [name for name, m in model.named_modules() if is_pointwise_conv(m)]
    for name in names:
        model.set_submodule(name, Conv1x1AsLinear.from_conv(model.get_submodule(name)))
    return names


def linears_to_conv1x1(model: nn.Module) -> list[str]:
    """Undo `conv1x1_to_linear`: the original Conv2d layers (same weights) come back."""
    names = [name for name, m in model.named_modules() if isinstance(m, Conv1x1AsLinear)]
    for name in names:
        model.set_submodule(name, model.get_submodule(name).to_conv())
    return names
