"""glibc's malloc and the large tensors of CPU inference: what keeps them from being mapped and
faulted in afresh at every call of a model (an image encoder's activations).

Why: glibc serves an allocation above its mmap threshold with a fresh mapping and unmaps it when
it is freed, and gives the top of its heap back to the system once more than its trim threshold
lies free there. Either way the next call faults the memory in again, one page fault and one
zeroed 4 KB page at a time, inside the kernel that first writes it: a matrix product with a 38 MB
output ran at under half its arithmetic rate that way (docs/notes.md, SAM 2).

Three tools, from the default up:
- `in_pieces`: compute in pieces whose intermediates stay below the largest threshold glibc uses
  (MMAP_THRESHOLD_MAX), so they come from the heap. genfast's SAM 2 encoder and the automatic mask
  generators' decoders do.
- `settle_thresholds()`, which every genfast process makes (genfast/interface/process.py): both
  thresholds at the values glibc's own adjustment reaches once a block at the ceiling has been
  freed (mmap 32 MB, trim twice that). Before that, how far they had risen depended on what the
  process happened to free earlier: the same compiled encoder faulted in 0 to ~110 MB per image
  from one process to the next, and took ~8% longer when it did.
- `keep_freed_memory()`, opt-in (`GENFAST_KEEP_FREED_MEMORY=1`): blocks up to THRESHOLD (1 GB)
  from the heap, and freed ones kept there. The heap fragments: PyTorch asks for aligned blocks,
  and a freed block is a little too small for the next aligned request of the same size, so a
  loop of one size can grow the heap instead of reusing it (measured: 64 MB more per iteration of
  a bare allocate-fill-free loop). Real models mix sizes and mostly reuse, but a long-running
  process should measure its own pattern before turning it on.
Off glibc none of the settings does anything.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

import torch
from torch import Tensor

ENV = "GENFAST_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30  # bytes: blocks below come from the heap; up to this much free heap is kept

# glibc raises its dynamic mmap threshold up to this as mapped blocks are freed; larger blocks
# are always mapped afresh.
MMAP_THRESHOLD_MAX = 32 << 20
# What `items_per_piece` keeps a piece's largest intermediate below: half the ceiling, as the
# trim threshold (twice the mmap threshold) must also hold the blocks alive beside it.
PIECE_BYTES = MMAP_THRESHOLD_MAX // 2

_kept = False
_settled = False


def items_per_piece(bytes_per_item: int) -> int:
    """How many items a piece holds when each adds `bytes_per_item` to its largest intermediate
    (at least one)."""
    return max(1, PIECE_BYTES // max(bytes_per_item, 1))


def in_pieces(fn: Callable[[Tensor], Tensor | tuple[Tensor, ...]], x: Tensor, per_piece: int) -> Tensor | tuple:
    """fn(x) for an fn that treats the entries of x's first dimension independently, computed on
    pieces of at most `per_piece` entries (as few pieces as that allows, of equal sizes) and
    concatenated along the first dimension (each output of a tuple). The same values as one call;
    the pieces' large intermediates are reused from the heap instead of mapped and faulted in
    afresh (the module's docstring)."""
    if x.shape[0] <= per_piece:
        return fn(x)
    pieces = -(-x.shape[0] // per_piece)
    # As many pieces as `per_piece` needs, of equal sizes: no short last piece that costs a call
    # of its own for a few entries.
    parts = [fn(piece) for piece in x.split(-(-x.shape[0] // pieces))]
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return tuple(torch.cat(outputs) for outputs in zip(*parts))


def keep_freed_memory() -> bool:
    """With GENFAST_KEEP_FREED_MEMORY=1, make malloc serve blocks below THRESHOLD from the heap
    and keep what is freed; returns whether it now does (idempotent). Both settings are needed:
    setting either one turns glibc's dynamic mmap threshold off, and the trim threshold alone
    leaves every block above 128 KB mapped afresh."""
    global _kept
    if _kept:
        return True
    mallopt = _mallopt() if os.environ.get(ENV, "0") == "1" else None
    if mallopt is None:
        return False
    _kept = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD))
    return _kept


def settle_thresholds() -> bool:
    """Set glibc's mmap threshold to its dynamic ceiling (MMAP_THRESHOLD_MAX) and its trim
    threshold to twice that: the state its dynamic adjustment reaches by itself once a block of
    that size has been freed, made at the start so that it does not depend on the process's past
    (the module's docstring). Nothing where keep_freed_memory() has raised them further, or off
    glibc. Returns whether they are now at least that high (idempotent)."""
    global _settled
    if _kept or _settled:
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    _settled = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX)
    )
    return _settled


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt; None elsewhere (musl has none, nor do macOS and Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim), after a stage that
    freed many blocks under the mmap threshold (which glibc raises up to 32 MB as large blocks
    are freed): quantizing a model layer by layer leaves its float weights' pages in the
    resident set otherwise, ~1 GiB of FLUX.1's (docs/notes.md). Not while GENFAST_KEEP_FREED_MEMORY
    keeps them on purpose; off glibc it does nothing. Returns whether memory was released."""
    if _kept or not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # not glibc
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return bool(trim(0))
