"""`torch.ops.genfast.upsampled_mask_stats` and `upsampled_mask_runs`: what the automatic mask
generator needs of each candidate mask at the image's size (pixel counts at two thresholds, the
box, the column runs), computed from its low-res logits with the bilinear upsampling done on the
fly (avx512.cpp says why, upsampled_masks.h how). genfast.sam.masks has the portable path, which
upsamples with F.interpolate and then measures.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genfast.kernels.native import Kernel, Variant

KERNEL = Kernel("upsampled_masks", "upsampled-mask statistics kernel", (Variant("avx512"), Variant("avx2")), rank=7)

torch.library.define(
    "genfast::upsampled_mask_stats",
    "(Tensor logits, int height, int width, float threshold, float offset) -> (Tensor, Tensor)",
)
torch.library.define(
    "genfast::upsampled_mask_runs",
    "(Tensor logits, int height, int width, float threshold) -> (Tensor, Tensor, Tensor, Tensor)",
)


@torch.library.register_fake("genfast::upsampled_mask_stats")
def _stats_fake(logits: Tensor, height: int, width: int, threshold: float, offset: float) -> tuple[Tensor, Tensor]:
    n = logits.shape[0]
    return logits.new_empty(n, 2, dtype=torch.int64), logits.new_empty(n, 4, dtype=torch.int64)


@torch.library.register_fake("genfast::upsampled_mask_runs")
def _runs_fake(logits: Tensor, height: int, width: int, threshold: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    k = torch.library.get_ctx().new_dynamic_size()
    return tuple(logits.new_empty(k, dtype=torch.int64) for _ in range(4))  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why the native kernel cannot run here, or None when it is loaded."""
    return KERNEL.unavailable_reason()


def takes(logits: Tensor) -> bool:
    """Whether the kernel takes these low-res logits: fp32 on the CPU (and it is loaded)."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and unavailable_reason() is None


def stats(logits: Tensor, size: tuple[int, int], threshold: float, offset: float) -> tuple[Tensor, Tensor]:
    """For low-res logits [N, h, w] upsampled bilinearly to `size` (H, W): pixels above
    threshold + offset and above threshold - offset, [N, 2] int64; XYXY boxes (inclusive) of the
    pixels above threshold, [N, 4] int64, [0, 0, 0, 0] for an empty mask."""
    return torch.ops.genfast.upsampled_mask_stats(logits.contiguous(), size[0], size[1], threshold, offset)


def runs(logits: Tensor, size: tuple[int, int], threshold: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """genfast.sam.masks.column_runs of the low-res logits [N, h, w] upsampled to `size` and
    thresholded: (mask index, column, start row, end row (exclusive)), int64 [K] each."""
    return torch.ops.genfast.upsampled_mask_runs(logits.contiguous(), size[0], size[1], threshold)
