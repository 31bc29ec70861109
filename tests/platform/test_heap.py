"""genfast.platform.heap's malloc settings, each case in its own interpreter (they are
process-wide): keep_freed_memory is opt-in, and once on a block above glibc's largest dynamic mmap
threshold (32 MB) comes from the heap (the [heap] mapping), where by default it is a mapping of its
own; settle_thresholds serves blocks below that ceiling from the heap from the start, where a fresh
process maps them."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
import torch
from genfast.platform import heap
done = [getattr(heap, name)() for name in sys.argv[1].split(",")][-1]
block = torch.empty(int(sys.argv[2]), dtype=torch.uint8)
with open("/proc/self/maps") as maps:
    heaps = [line.split()[0] for line in maps if line.rstrip().endswith("[heap]")]
start, end = (int(x, 16) for x in heaps[0].split("-")) if heaps else (0, 0)
print(done, start <= block.data_ptr() < end)
"""


def _run(value: str | None, setting: str = "keep_freed_memory", block_bytes: int = 64 << 20) -> tuple[bool, bool]:
    """(what the last of the settings, comma-separated, returned; whether a fresh block of
    `block_bytes` then lies in the heap)."""
    env = {k: v for k, v in os.environ.items() if k != "GENFAST_KEEP_FREED_MEMORY"}
    if value is not None:
        env["GENFAST_KEEP_FREED_MEMORY"] = value
    command = [sys.executable, "-c", SCRIPT, setting, str(block_bytes)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    done, in_heap = out.stdout.split()
    return done == "True", in_heap == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings (Linux)")
def test_large_blocks_come_from_the_heap_when_asked():
    assert _run("1") == (True, True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings (Linux)")
def test_off_by_default():
    assert _run(None) == (False, False)
    assert _run("0") == (False, False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings (Linux)")
def test_settled_thresholds_serve_blocks_below_the_ceiling_from_the_heap_from_the_start():
    below, above = 20 << 20, 40 << 20
    assert _run(None, "settle_thresholds", below) == (True, True)
    assert _run(None, "settle_thresholds", above) == (True, False)  # the ceiling stays: mapped
    # What the setting changes: a fresh process maps the same block (until it has freed one).
    assert _run(None, "release_freed_memory", below)[1] is False
    # Where keep_freed_memory has raised the thresholds further, settling leaves them there.
    assert _run("1", "keep_freed_memory,settle_thresholds", above) == (True, True)


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
    torch.testing.assert_close(in_pieces(lambda p: twice(p)[0], x[:9], 4), x[:9] * 2, rtol=0, atol=0)
    assert sizes == [3, 3, 3]  # the three pieces that 4 a piece needs, of equal sizes (not 4, 4, 1)
    sizes.clear()
    torch.testing.assert_close(in_pieces(lambda p: twice(p)[0], x, 10), x * 2, rtol=0, atol=0)
    assert sizes == [10]  # one piece: a single call


def test_items_per_piece_keeps_a_piece_under_the_budget():
    from genfast.platform.heap import MMAP_THRESHOLD_MAX, PIECE_BYTES, items_per_piece

    assert PIECE_BYTES < MMAP_THRESHOLD_MAX
    assert items_per_piece(4 << 20) == PIECE_BYTES // (4 << 20)
    assert items_per_piece(3 << 20) * (3 << 20) <= PIECE_BYTES < (items_per_piece(3 << 20) + 1) * (3 << 20)
    assert items_per_piece(PIECE_BYTES * 3) == 1  # one item larger than the budget: pieces of one
