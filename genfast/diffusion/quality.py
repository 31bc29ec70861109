"""Image agreement with the baseline: PSNR, the metric of the diffusion ladder."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def psnr(image: Tensor, reference: Tensor, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB of `image` vs `reference` (same shape, values in
    [0, data_range]); inf for identical images."""
    if image.shape != reference.shape:
        raise ValueError(f"PSNR needs images of one shape, got {tuple(image.shape)} and {tuple(reference.shape)}")
    mse = torch.mean((image.double() - reference.double()) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(data_range**2 / mse)
