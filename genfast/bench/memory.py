"""Peak memory of this process on a device."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_bytes(device: torch.device | str) -> int:
    """CUDA: peak allocated by torch; CPU: the process's peak resident set size."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def reset_peak_memory(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
