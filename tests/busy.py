"""Processes that keep CPUs busy, for the tests of what genfast does beside other work."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

BUSY_LOOP = [sys.executable, "-c", "while True: pass"]

needs_proc = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="samples /proc (Linux)")


def background_busy_cores(seconds: float = 0.5) -> float:
    """The cores other programs keep busy at normal priority now (genfast.platform.threads.OtherWork;
    0 where /proc says nothing): what a test's own busy loops come on top of, since a user's machine
    is never quiet."""
    from genfast.platform.threads import OtherWork

    sample = OtherWork()
    time.sleep(seconds)
    return sample.busy_cores() or 0.0


def skip_if_busy_beside(most: float = 0.4) -> None:
    """Skip a test of what genfast does beside the test's own busy loops when other programs keep
    `most` CPUs or more busy already: genfast rightly computes beside those too, so the loops'
    effect cannot be told apart."""
    busy = background_busy_cores()
    if busy >= most:
        pytest.skip(f"other programs keep {busy:.1f} CPUs busy: the test's own busy loops cannot be told apart")


@contextmanager
def busy_loop(nice: int = 0, count: int = 1) -> Iterator[None]:
    """`count` processes spinning on a core each, in sessions of their own, niced as a whole with
    `nice` (genfast.llm.decoding.precompiled.lower_priority)."""
    from genfast.llm.decoding.precompiled import lower_priority

    loops = [subprocess.Popen(BUSY_LOOP, start_new_session=True) for _ in range(count)]
    try:
        if nice:
            for loop in loops:
                lower_priority(loop.pid)
        time.sleep(0.2)  # running
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@contextmanager
def threads_restored() -> Iterator[int]:
    """For a command run in this process, which may change torch's thread count: the count before
    it, restored afterwards."""
    before = torch.get_num_threads()
    try:
        yield before
    finally:
        torch.set_num_threads(before)
