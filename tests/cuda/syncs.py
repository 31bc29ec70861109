"""What the CUDA tests share: they run where torch sees a GPU and are skipped elsewhere (CI has
none; scripts/gpu_check.sh runs them on a GPU machine)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on one)"
)


@contextmanager
def host_syncs() -> Iterator[list[str]]:
    """Collect every host-device synchronization CUDA's sync-debug mode reports in the block
    (a `.item()`, a blocking copy, a stream or device synchronize)."""
    found: list[str] = []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (the mode's own notice that it is a prototype is not a sync)
    found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message) and "prototype" not in str(w.message))
