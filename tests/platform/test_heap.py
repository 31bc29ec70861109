"""genfast.platform.heap: opt-in; once on, a block above glibc's largest dynamic mmap threshold
(32 MB) comes from the heap (the [heap] mapping), where by default it is a mapping of its own.
Each case runs in its own interpreter: the settings are process-wide."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import torch
from genfast.platform.heap import keep_freed_memory
kept = keep_freed_memory()
block = torch.empty(64 << 20, dtype=torch.uint8)
with open("/proc/self/maps") as maps:
    heap = [line.split()[0] for line in maps if line.rstrip().endswith("[heap]")]
start, end = (int(x, 16) for x in heap[0].split("-")) if heap else (0, 0)
print(kept, start <= block.data_ptr() < end)
"""


def _run(value: str | None) -> tuple[bool, bool]:
    env = {k: v for k, v in os.environ.items() if k != "GENFAST_KEEP_FREED_MEMORY"}
    if value is not None:
        env["GENFAST_KEEP_FREED_MEMORY"] = value
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    kept, in_heap = out.stdout.split()
    return kept == "True", in_heap == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings (Linux)")
def test_large_blocks_come_from_the_heap_when_asked():
    assert _run("1") == (True, True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings (Linux)")
def test_off_by_default():
    assert _run(None) == (False, False)
    assert _run("0") == (False, False)


def test_in_pieces_gives_one_call_values_from_pieces_of_the_size_asked():
    import torch

    from genfast.platform.heap import in_pieces

    x = torch.arange(10.0)[:, None].expand(10, 3)
    sizes = []

    def twice(piece):
        sizes.append(len(piece))
        return piece * 2, piece.sum(1)

    doubled, sums = in_pieces(twice, x, 4)
    assert sizes == [4, 4, 2]
    torch.testing.assert_close(doubled, x * 2, rtol=0, atol=0)
    torch.testing.assert_close(sums, x.sum(1), rtol=0, atol=0)
    sizes.clear()
    torch.testing.assert_close(in_pieces(lambda p: twice(p)[0], x, 10), x * 2, rtol=0, atol=0)
    assert sizes == [10]  # one piece: a single call


def test_items_per_piece_keeps_a_piece_under_the_budget():
    from genfast.platform.heap import MMAP_THRESHOLD_MAX, PIECE_BYTES, items_per_piece

    assert PIECE_BYTES < MMAP_THRESHOLD_MAX
    assert items_per_piece(4 << 20) == PIECE_BYTES // (4 << 20)
    assert items_per_piece(3 << 20) * (3 << 20) <= PIECE_BYTES < (items_per_piece(3 << 20) + 1) * (3 << 20)
    assert items_per_piece(PIECE_BYTES * 3) == 1  # one item larger than the budget: pieces of one
