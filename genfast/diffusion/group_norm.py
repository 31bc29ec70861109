"""GroupNorm for channels-last activations on the CPU, with a native kernel.

A UNet's or VAE decoder's GroupNorm at high resolution is memory-bound work that inductor and
ATen both run several times slower than the memory allows on channels-last tensors (see
genfast/kernels/group_norm_avx512.cpp; an AVX2 variant does the same). `ChannelsLastGroupNorm`
keeps nn.GroupNorm's parameters and state-dict names, and runs `torch.ops.genfast.group_norm_nhwc`
(an ordinary custom op: torch.compile calls it without a graph break) when the input is
channels-last fp32/bf16 with channels a multiple of 16 on a CPU with AVX-512 or AVX2; otherwise
`F.group_norm`, so it is always safe to swap in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.kernels import GROUP_NORM

torch.library.define(
    "genfast::group_norm_nhwc", "(Tensor x, int groups, Tensor weight, Tensor bias, float eps) -> Tensor"
)


@torch.library.register_fake("genfast::group_norm_nhwc")
def _group_norm_nhwc_fake(x: Tensor, groups: int, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.channels_last)


def unavailable_reason() -> str | None:
    """Why the native kernel cannot run here, or None when it is loaded."""
    return GROUP_NORM.unavailable_reason()


class ChannelsLastGroupNorm(nn.Module):
    """nn.GroupNorm (same parameters) with the native kernel for channels-last CPU inputs."""

    def __init__(self, norm: nn.GroupNorm) -> None:
        super().__init__()
        self.num_groups, self.num_channels, self.eps = norm.num_groups, norm.num_channels, norm.eps
        self.affine = norm.affine
        self.weight, self.bias = norm.weight, norm.bias
        self.native = (
            norm.num_channels % 16 == 0
            and next(iter(norm.parameters()), torch.empty(0)).device.type == "cpu"
            and unavailable_reason() is None
        )

    def forward(self, x: Tensor) -> Tensor:
        if (
            self.native
            and x.dim() == 4
            and x.dtype in (torch.float32, torch.bfloat16)
            and x.is_contiguous(memory_format=torch.channels_last)
        ):
            weight = self.weight if self.affine else x.new_ones(self.num_channels)
            bias = self.bias if self.affine else x.new_zeros(self.num_channels)
            return torch.ops.genfast.group_norm_nhwc(x, self.num_groups, weight, bias, self.eps)
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

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
