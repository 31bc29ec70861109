"""An LLM's weights in transparent huge pages (Linux): fewer TLB misses while decode streams them.

Why: batch-1 decode reads every weight once per token, hundreds of MB in long sequential streams.
In 4 KB pages that is a page walk per 4 KB read (under a hypervisor a two-level one), and the
hardware prefetchers stop at each 4 KB boundary. Linux backs an anonymous mapping with 2 MB
pages where the program asks for them (`madvise(MADV_HUGEPAGE)`; the default THP mode of most
distributions is `madvise`, under which PyTorch's allocator never asks). The linears of a decode
step run measurably faster from one huge-page mapping than from their own allocations.

`move_to_hugepages(module)` copies a module's parameters and persistent buffers into one new
mapping, each tensor its own storage (so nothing aliases in the compiled code's inputs), and
frees the old memory as it goes, handing it back to the system every RELEASE_EVERY bytes (peak
memory grows by about that much, not by the module). The mapping lives as long as any tensor in
it. `GENFAST_HUGEPAGES=0` turns this off.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

ENV = "GENFAST_HUGEPAGES"
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # a cache line: no line holds two tensors
RELEASE_EVERY = 64 << 20  # bytes moved between two hand-backs of the freed memory
MIN_BYTES = 4096  # smaller ones (most norms, biases) fit in one 4 KB page anyway: left where they are


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (always | madvise | never), None where unknown."""
    try:
        text = THP_MODE_FILE.read_text()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def unavailable_reason() -> str | None:
    """Why weights are not placed in huge pages here, or None when they are."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "transparent huge pages are Linux-only"
    mode = thp_mode()
    if mode is None:
        return f"no {THP_MODE_FILE} (kernel without transparent huge pages)"
    if mode == "never":
        return f"transparent huge pages are off ({THP_MODE_FILE}: never)"
    return None


def describe() -> str:
    """Where an LLM's weights are placed on this machine, for `genfast info` and bench tables."""
    reason = unavailable_reason()
    return f"in 4 KB pages ({reason})" if reason else f"asked for 2 MB pages (transparent huge pages: {thp_mode()})"


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping advised for huge pages, and the offset of its first 2 MB
    boundary (a huge page only backs an aligned 2 MB range)."""
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    return buffer, -address % HUGE_PAGE


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor in huge-page memory (as `move_to_hugepages` places weights),
    or in PyTorch's own where `unavailable_reason()`."""
    if unavailable_reason() is not None:
        return torch.empty(shape, dtype=dtype)
    count = math.prod(shape)
    buffer, start = _mapping(count * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=start).view(shape)


def move_to_hugepages(module: nn.Module) -> int:
    """Move `module`'s CPU parameters and persistent buffers of at least MIN_BYTES into one new
    huge-page mapping, in module order; returns the bytes moved (0 where `unavailable_reason()`).

    Tensors that share a storage (tied weights) stay shared; views into a larger storage are left
    where they are. Parameters keep their identity (their `.data` is replaced). Each old tensor is
    freed as soon as it is copied, unless something else holds it."""
    if unavailable_reason() is not None:
        return 0
    entries: list[tuple[nn.Module, str, int]] = []  # (owner, name, storage address); no tensors:
    # holding the old ones would keep their memory until the end
    offsets: dict[int, int] = {}  # old storage address -> offset in the new mapping
    total = 0
    for owner, name, tensor in movable_tensors(module):
        # Read now: replacing a parameter's .data changes the address it reports.
        address = tensor.untyped_storage().data_ptr()
        entries.append((owner, name, address))
        if address not in offsets:
            offsets[address] = total
            total += -(-tensor.nbytes // ALIGNMENT) * ALIGNMENT
    if not entries:
        return 0
    buffer, start = _mapping(total)
    moved: dict[int, torch.Tensor] = {}
    since_release = 0
    for owner, name, address in entries:
        current = owner._parameters[name] if name in owner._parameters else owner._buffers[name]
        if address not in moved:
            new = torch.frombuffer(buffer, dtype=current.dtype, count=current.numel(), offset=start + offsets[address])
            moved[address] = new.view(current.shape).copy_(current)
        target = moved[address]
        if (target.dtype, target.shape) != (current.dtype, current.shape):  # one storage seen as two tensors
            target = target.view(current.dtype).view(current.shape)
        if name in owner._parameters:
            owner._parameters[name].data = target
        else:
            owner._buffers[name] = target
        since_release += target.nbytes
        if since_release >= RELEASE_EVERY:
            _release_freed_memory()
            since_release = 0
    _release_freed_memory()
    return total


@cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def _release_freed_memory() -> None:
    """Hand the freed tensors' memory back to the system: glibc keeps freed blocks below its mmap
    threshold (up to 32 MB) in the heap, so without this a small model's old weights stayed
    resident beside the moved ones (SmolLM2: +250 MB until exit)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def movable_tensors(module: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """(owner, name, tensor) of each parameter and persistent buffer `move_to_hugepages` moves."""
    for owner in module.modules():
        persistent = [(n, b) for n, b in owner._buffers.items() if n not in owner._non_persistent_buffers_set]
        for name, tensor in [*owner._parameters.items(), *persistent]:
            if _movable(tensor):
                yield owner, name, tensor


def _movable(tensor: torch.Tensor | None) -> bool:
    if tensor is None or tensor.device.type != "cpu" or tensor.nbytes < MIN_BYTES:
        return False
    if type(tensor) not in (torch.Tensor, nn.Parameter) or not tensor.is_contiguous():
        return False  # subclasses (quantized, sparse) keep their own storage
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes


def _smaps() -> list[tuple[int, int, bool, int]]:
    """This process's mappings: (start, end, advised for huge pages, bytes in huge pages)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return []
    mappings: list[tuple[int, int, bool, int]] = []
    start = end = huge = 0
    for line in lines:
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = head.split("-")
            start, end, huge = int(lo, 16), int(hi, 16), 0
        elif head == "AnonHugePages:":
            huge = int(line.split()[1]) * 1024
        elif head == "VmFlags:":
            mappings.append((start, end, "hg" in line.split()[1:], huge))
    return mappings


def placement(module: nn.Module) -> tuple[int, int, int]:
    """Bytes of `module`'s parameters and buffers: in all, in huge-page-advised mappings, and in
    2 MB pages the kernel actually granted (it may not, e.g. when memory is fragmented). Tensors
    that were not moved can be in advised memory too: other code may have advised memory that the
    allocator later reuses (numpy, for one, advises its large buffers; seen in the test suite)."""
    mappings = _smaps()
    tensors = {t.untyped_storage().data_ptr(): t.nbytes for t in [*module.parameters(), *module.buffers()]}
    total = sum(tensors.values())
    advised = sum(n for a, n in tensors.items() if any(lo <= a < hi and hg for lo, hi, hg, _ in mappings))
    granted = sum(huge for lo, hi, hg, huge in mappings if hg and any(lo <= a < hi for a in tensors))
    return total, advised, min(granted, advised)
