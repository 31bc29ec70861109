"""glibc's malloc told to keep large freed blocks for reuse, for CPU inference that allocates the
same large tensors on every call (an image encoder's activations, a UNet's, a prefill's).

Why: glibc serves an allocation above its mmap threshold (dynamic, 128 KB up to 32 MB) with a
fresh mapping and unmaps it when it is freed. Every call of a model whose intermediates exceed
32 MB then faults its outputs in afresh, one page fault and one zeroed 4 KB page at a time,
inside the kernel that first writes them: a matrix product with a 38 MB output ran at under half
its arithmetic rate that way (the measurements are in docs/notes.md).

`keep_freed_memory()` raises the mmap threshold and the trim threshold together (mallopt), so
blocks up to THRESHOLD come from the heap and freed ones stay there for the next call. The cost:
the process keeps its peak memory instead of handing it back between calls (an explicit
`malloc_trim`, as `genfast.platform.hugepages` does, still hands it back). The CLI applies it on
start; `GENFAST_KEEP_FREED_MEMORY=0` turns it off, and off glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

ENV = "GENFAST_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30  # bytes: blocks below come from the heap; up to this much free heap is kept

_kept = False


def keep_freed_memory() -> bool:
    """Make malloc serve blocks below THRESHOLD from the heap and keep what is freed; returns
    whether it now does (idempotent). Both settings are needed: setting either one turns glibc's
    dynamic mmap threshold off, and the trim threshold alone leaves every block above 128 KB
    mapped afresh."""
    global _kept
    if _kept:
        return True
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _kept = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD))
    return _kept
