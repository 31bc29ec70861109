"""Timing a callable the way the benchmark scripts report it: one warm-up call, then the median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `repeats` calls of `fn`, after one untimed call (compiling, caches)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
