"""`torch.ops.genfast.group_norm_nhwc`: GroupNorm of a channels-last tensor in two passes over
memory (avx512.cpp says why the kernel exists, group_norm.h has the math). `group_norm` takes it
where it applies and `F.group_norm`, the portable path, elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from genfast.kernels.native import Kernel, Variant

KERNEL = Kernel("group_norm", "GroupNorm CPU kernel", (Variant("avx512"), Variant("avx2")), rank=4)

CHANNEL_MULTIPLE = 16  # the channel counts group_norm.h takes: whole 16-lane vectors
DTYPES = (torch.float32, torch.bfloat16)  # every variant's

torch.library.define(
    "genfast::group_norm_nhwc", "(Tensor x, int groups, Tensor weight, Tensor bias, float eps) -> Tensor"
)


@torch.library.register_fake("genfast::group_norm_nhwc")
def _group_norm_nhwc_fake(x: Tensor, groups: int, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.channels_last)


def unavailable_reason() -> str | None:
    """Why the native kernel cannot run here, or None when it is loaded."""
    return KERNEL.unavailable_reason()


def takes_channels(channels: int, device: torch.device) -> bool:
    """Whether a norm over `channels` on `device` can run the kernel (and it is loaded)."""
    return channels % CHANNEL_MULTIPLE == 0 and device.type == "cpu" and unavailable_reason() is None


def takes(x: Tensor) -> bool:
    """Whether the kernel takes this input: 4-d, channels-last, fp32 or bf16."""
    return x.dim() == 4 and x.dtype in DTYPES and x.is_contiguous(memory_format=torch.channels_last)


def group_norm(x: Tensor, groups: int, weight: Tensor | None, bias: Tensor | None, eps: float, native: bool) -> Tensor:
    """F.group_norm of `x`, by the kernel where `native` (a `takes_channels` answer the caller keeps)
    and `takes(x)`, else by F.group_norm. The kernel wants a weight and a bias: a norm without them
    passes ones and zeros."""
    if native and takes(x):
        channels = x.shape[1]
        weight = weight if weight is not None else x.new_ones(channels)
        bias = bias if bias is not None else x.new_zeros(channels)
        return torch.ops.genfast.group_norm_nhwc(x, groups, weight, bias, eps)
    return F.group_norm(x, groups, weight, bias, eps)
