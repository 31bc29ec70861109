"""Driver scripts on the test cluster, and finding and killing the Ray Data actors of a batch run,
to check that a lost worker loses no item."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def run_driver(script: str) -> str:
    """Run `script` as a Python driver program; the last word it printed (what its pipeline returned)."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


def map_workers(callable_class: str) -> list[int]:
    """The pids of this machine's Ray Data actor processes that run `callable_class` (its name)."""
    marker = f"MapWorker(MapBatches({callable_class}))".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def kill_a_worker_midway(process: subprocess.Popen, callable_class: str, started: Callable[[], bool]) -> None:
    """Once `started()` (outputs have begun to come out of the batch run `process`), SIGKILL one of
    its Ray Data workers running `callable_class`."""
    deadline = time.monotonic() + 240
    while not started():
        assert process.poll() is None, process.stderr.read() if process.stderr else process.returncode
        assert time.monotonic() < deadline, "no outputs within four minutes"
        time.sleep(0.05)
    workers = map_workers(callable_class)
    assert workers, f"no Ray Data worker running {callable_class} was found"
    os.kill(workers[0], signal.SIGKILL)


def run_killing_a_worker(
    command: list[str], callable_class: str, started: Callable[[], bool], written: Callable[[], int]
) -> tuple[int, str, int]:
    """Run the batch `command`, SIGKILL one of its workers running `callable_class` once `started()`,
    and let it finish: (exit status, stderr, outputs `written()` by the time of the kill)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        kill_a_worker_midway(process, callable_class, started)
        written_before = written()
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err, written_before
