"""Threads beside other work (genfast/platform/threads.py): what a busy process at normal priority counts
for and what a niced one does not, the thread count chosen from it, and the CLI's choice with a
busy loop beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from genfast.platform import threads
from genfast.platform.threads import OtherWork, avoid_busy_cores, threads_beside
from tests.busy import BUSY_LOOP, background_busy_cores, busy_loop, needs_proc, skip_if_busy_beside

pytestmark = pytest.mark.alone


@pytest.mark.parametrize(
    ("busy", "default", "cpus", "expected"),
    [
        (0.0, 2, 2, 2),
        (0.4, 2, 2, 2),  # less than half a core: not worth a thread
        (0.8, 2, 2, 1),
        (1.9, 2, 2, 1),  # never fewer than one
        (1.0, 4, 8, 4),  # two logical CPUs per core: room beside the team
        (5.2, 4, 8, 3),
    ],
)
def test_the_thread_count_leaves_the_busy_cpus_to_the_other_work(busy, default, cpus, expected):
    assert threads_beside(busy, default, cpus) == expected


@needs_proc
def test_a_busy_process_counts_and_a_niced_one_does_not():
    """On top of what other programs keep busy (measured before and after: a test must not depend
    on a quiet machine)."""
    before = background_busy_cores()
    with busy_loop():
        busy = OtherWork().busy_cores()
    with busy_loop(nice=19):
        niced = OtherWork().busy_cores()
    after = background_busy_cores()
    assert busy is not None and niced is not None
    assert busy - max(before, after) >= 0.6, (busy, before, after)
    assert niced - min(before, after) < 0.4, (niced, before, after)


@needs_proc
def test_this_process_own_work_and_its_children_do_not_count():
    before = background_busy_cores(threads.MIN_SAMPLE_S + 0.3)
    sample = OtherWork()
    end = time.monotonic() + threads.MIN_SAMPLE_S
    while time.monotonic() < end:
        pass
    subprocess.run([*BUSY_LOOP[:2], "import time; end = time.monotonic() + 0.3\nwhile time.monotonic() < end: pass"])
    busy = sample.busy_cores()
    after = background_busy_cores(threads.MIN_SAMPLE_S + 0.3)
    assert busy is not None and busy - min(before, after) < 0.4, (busy, before, after)


def test_the_count_is_set_and_said_only_when_it_is_fewer(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    messages: list[str] = []
    for busy in (0.0, None):
        monkeypatch.setattr(OtherWork, "busy_cores", lambda self, busy=busy: busy)
        avoid_busy_cores(OtherWork(), messages.append)
    assert chosen == [] and messages == []
    monkeypatch.setattr(OtherWork, "busy_cores", lambda self: 1.0)
    avoid_busy_cores(OtherWork(), messages.append)
    assert chosen == [1]
    assert messages == [
        "genfast: other processes kept 1.0 CPUs busy while the model loaded: computing on 1 thread, not 2 "
        "(--threads N to choose)"
    ]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice
    avoid_busy_cores(OtherWork(), messages.append)
    assert chosen == [1] and len(messages) == 1


@needs_proc
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_generate_computes_on_fewer_threads_beside_a_busy_loop_unless_told(smollm2_gguf):
    argv = [sys.executable, "-m", "genfast", "generate", "hello", "--model", str(smollm2_gguf), "--no-compile",
            "--dtype", "float32", "-n", "2"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    skip_if_busy_beside()
    with busy_loop(count=2):  # more than a CPU busy however the load competes with them
        chosen = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        told = subprocess.run([*argv, "--threads", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert chosen.returncode == 0 and told.returncode == 0, chosen.stderr + told.stderr
    physical = int(subprocess.check_output([sys.executable, "-c", "import torch; print(torch.get_num_threads())"]))
    if physical >= 2:
        assert "CPUs busy while the model loaded: computing on" in chosen.stderr
    assert "CPUs busy" not in told.stderr


@needs_proc
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_chat_follows_other_work_that_starts_and_stops_between_turns(smollm2_gguf):
    """Measured while the chat waits for the user: busy loops that start after the first turn take
    a thread away at the next one, and it comes back once they stop."""
    argv = [sys.executable, "-m", "genfast", "chat", "--model", str(smollm2_gguf), "--no-compile",
            "--dtype", "float32", "-n", "2"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    skip_if_busy_beside()
    chat = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip

    def turn(message: str) -> str:
        """What the chat said on stderr up to the turn's summary line."""
        chat.stdin.write(message + "\n")
        chat.stdin.flush()
        said = []
        while not (line := chat.stderr.readline()).startswith("["):
            assert line, "the chat ended early: " + "".join(said)
            said.append(line)
        return "".join(said)

    try:
        first = turn("Hello")
        with busy_loop(count=2):
            time.sleep(1.0)  # the user typing
            busy = turn("And then?")
        time.sleep(1.0)
        idle = turn("Thanks")
        chat.stdin.close()
        assert chat.wait(timeout=60) == 0
    finally:
        chat.kill()
    physical = int(subprocess.check_output([sys.executable, "-c", "import torch; print(torch.get_num_threads())"]))
    assert "CPUs busy" not in first
    if physical >= 2:
        assert f"CPUs busy: computing on 1 thread, not {physical}" in busy
        assert f"CPUs busy: computing on {physical} threads, not 1" in idle
    else:
        assert "CPUs busy" not in busy + idle


@needs_proc
def test_a_child_reaped_during_the_sample_counts_only_its_time_within_it():
    """A child that burned CPU before the sample and is reaped during it moves all that time into
    this process's cutime; counted as this process's work in the sample, it hid a busy loop beside
    it. (Inductor's compile workers can end so: the likely cause of one failure of the diffusion CLI's
    'beside busy work' test.)"""
    burn = (
        "import sys, time\nend = time.process_time() + 0.6\n"
        "while time.process_time() < end: pass\nprint(flush=True)\nsys.stdin.read()"
    )
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    child.stdout.readline()  # it has burned its time and waits
    with busy_loop():
        sample = OtherWork()
        child.communicate(b"")  # it ends and is reaped within the sample
        busy = sample.busy_cores()
    assert busy is not None and busy >= 0.6, busy
