"""GroupNorm for channels-last activations on the CPU, with the native kernel
(genfast/kernels/group_norm/).

A UNet's or VAE decoder's GroupNorm at high resolution is memory-bound work that inductor and
ATen both run several times slower than the memory allows on channels-last tensors.
`ChannelsLastGroupNorm` keeps nn.GroupNorm's parameters and state-dict names, and runs the kernel
(an ordinary custom op: torch.compile calls it without a graph break) when the input is
channels-last fp32/bf16 with channels a multiple of 16 on a CPU with AVX-512 or AVX2; otherwise
`F.group_norm`, so it is always safe to swap in.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from genfast.kernels.group_norm import ops as kernel


class ChannelsLastGroupNorm(nn.Module):
    """nn.GroupNorm (same parameters) with the native kernel for channels-last CPU inputs."""

    def __init__(self, norm: nn.GroupNorm) -> None:
        super().__init__()
        self.num_groups, self.num_channels, self.eps = norm.num_groups, norm.num_channels, norm.eps
        self.affine = norm.affine
        self.weight, self.bias = norm.weight, norm.bias
        device = next(iter(norm.parameters()), torch.empty(0)).device
        self.native = kernel.takes_channels(norm.num_channels, device)

    def forward(self, x: Tensor) -> Tensor:
        return kernel.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, self.native)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, native={self.native}"


def use_channels_last_group_norm(model: nn.Module) -> int:
    """Swap every nn.GroupNorm of `model` for a ChannelsLastGroupNorm in place; returns how many
    use the native kernel (0 where it is unavailable: then nothing changes numerically)."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.GroupNorm:
            replacement = ChannelsLastGroupNorm(module)
            model.set_submodule(name, replacement)
            swapped += replacement.native
    return swapped
