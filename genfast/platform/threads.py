"""How many CPU threads to compute on when other processes keep some cores busy.

PyTorch's default is one thread per physical core. Every parallel region of a step (~150 in a
SmolLM2 decode step) ends when its slowest thread does, so a thread that shares its core with a busy
process at the same priority holds the whole team back: beside one busy loop, a 2-core decode on
two threads runs several times slower, and slower than on one thread. `OtherWork` samples how many cores other
processes keep busy (Linux: /proc), and `threads_beside` leaves those cores to them.

Work at a lower priority (nice > 0, such as genfast's own background compile) yields to this
process and does not count.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from genfast.interface.startup import proc_stat

# Shorter samples are too coarse: /proc counts CPU time in 10 ms ticks.
MIN_SAMPLE_S = 0.25
# Other work that keeps at least this many CPUs busy on average takes a thread away (and a
# benchmark row timed beside it says so).
BUSY_CPUS_THAT_COUNT = 0.5


def _descendants() -> list[str]:
    """The PIDs of this process's live descendants (Linux: /proc/PID/task/TID/children; none
    where the kernel does not list them)."""
    found, parents = [], ["self"]
    while parents:
        for listing in Path(f"/proc/{parents.pop()}/task").glob("*/children"):
            try:
                children = listing.read_text().split()
            except OSError:  # the thread or process ended meanwhile
                continue
            found += children
            parents += children
    return found


def _cpu_ticks(fields: list[str]) -> int:
    """A process's CPU time and its reaped children's (utime, stime, cutime, cstime)."""
    return sum(int(fields[i]) for i in (11, 12, 13, 14))


def _ticks() -> tuple[int, int] | None:
    """(CPU ticks spent at normal priority by the whole machine, by this process and its
    descendants) so far, or None where /proc does not say."""
    try:
        machine = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    own = proc_stat()
    if not machine or machine[0] != "cpu" or len(machine) < 8 or own is None or len(own) < 15:
        return None
    user, system, irq, softirq = (int(machine[i]) for i in (1, 3, 6, 7))  # not nice, idle, iowait, steal
    if os.getpriority(os.PRIO_PROCESS, 0) > 0:  # this process's time is counted as "nice", not "user"
        return user + system + irq + softirq, 0
    # Its own time, its reaped children's (a kernel build's compiler), and its live descendants'
    # (inductor's compile workers), so that the difference of two samples is the tree's time in
    # between: a child that is reaped between them moves its whole time, most of it from before
    # the first, into cutime. Counting cutime alone made that time negative other work, and a
    # busy machine looked idle. Not counted: niced descendants (their time is "nice" too) and those
    # in a session of their own, started to outlive this process (genfast's background compile).
    mine = _cpu_ticks(own)
    for pid in _descendants():
        fields = proc_stat(pid)
        if fields is not None and len(fields) > 16 and fields[3] == own[3] and int(fields[16]) <= 0:
            mine += _cpu_ticks(fields)
    return user + system + irq + softirq, mine


class OtherWork:
    """The cores other processes keep busy at normal priority, on average from creation to
    `busy_cores()`."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.start = _ticks()

    def busy_cores(self, wait: bool = True) -> float | None:
        """Waits until MIN_SAMPLE_S have passed since creation (`wait`; otherwise None if they have
        not); None where /proc says nothing."""
        if self.start is None:
            return None
        left = self.started + MIN_SAMPLE_S - time.monotonic()
        if left > 0 and not wait:
            return None
        time.sleep(max(0.0, left))
        end = _ticks()
        if end is None:
            return None
        seconds = time.monotonic() - self.started
        others = (end[0] - self.start[0]) - (end[1] - self.start[1])
        return max(0.0, others / os.sysconf("SC_CLK_TCK") / seconds)


def threads_beside(busy_cores: float, threads: int, cpus: int) -> int:
    """Threads to use out of `threads` (one per physical core) on `cpus` logical CPUs while other
    processes keep `busy_cores` busy: no more than the CPUs they leave free, at least one. With
    two logical CPUs per core there is room for the other work beside the team."""
    return max(1, min(threads, cpus - math.floor(busy_cores + 1 - BUSY_CPUS_THAT_COUNT)))


def threads_for(busy_cores: float, most: int | None = None) -> int:
    """`threads_beside` for this process: out of `most` (default: torch's count), on the CPUs it
    may run on."""
    most = torch.get_num_threads() if most is None else most
    return threads_beside(busy_cores, most, len(os.sched_getaffinity(0)))


def _users_count() -> bool:
    """Whether the user chose the thread count through the environment (--threads callers do not
    ask)."""
    return "OMP_NUM_THREADS" in os.environ


def use_threads(threads: int | None) -> OtherWork | None:
    """The user's count (--threads), set now; without one, a sample of the other work that starts
    now, for `avoid_busy_cores` once the model has loaded on the CPU."""
    if threads is not None:
        torch.set_num_threads(threads)
        return None
    return OtherWork()


def avoid_busy_cores(sample: OtherWork, log: Callable[[str], None]) -> None:
    """Set torch's thread count for the work measured by `sample` (started before the model loaded),
    and say so when it is fewer than torch's default. Not where the user chose a count
    (OMP_NUM_THREADS; --threads callers do not call this)."""
    if _users_count():
        return
    busy = sample.busy_cores()
    if busy is None:
        return
    default = torch.get_num_threads()
    threads = threads_for(busy)
    if threads < default:
        torch.set_num_threads(threads)
        log(
            f"genfast: other processes kept {busy:.1f} CPUs busy while the model loaded: computing on "
            f"{threads} thread{'s' if threads > 1 else ''}, not {default} (--threads N to choose)"
        )


def follow_other_work(sample: OtherWork, most: int, log: Callable[[str], None]) -> None:
    """Fit the thread count, at most `most`, to the other work measured by `sample` since it was
    taken (a chat's wait for the user, a server's last few seconds; shorter than MIN_SAMPLE_S:
    nothing changes, it does not wait to measure), back to `most` once that work stops; `log` says
    when the count changes. Only where `avoid_busy_cores` chose the count. A change between steps
    is safe for the compiled steps genfast saves: they read the count at run time."""
    busy = None if _users_count() else sample.busy_cores(wait=False)
    if busy is None:
        return
    now, threads = torch.get_num_threads(), threads_for(busy, most)
    if threads != now:
        torch.set_num_threads(threads)
        log(f"genfast: other processes kept {busy:.1f} CPUs busy: computing on {threads} thread"
            f"{'s' if threads > 1 else ''}, not {now}")  # fmt: skip
