"""Start-up figures: seconds since the process was launched, and named phases."""

from __future__ import annotations

import subprocess
import sys

from genfast.interface.startup import Phases, since_launch


def test_the_clock_starts_at_launch_not_at_import():
    code = "import time; time.sleep(0.5); from genfast.interface.startup import since_launch; print(since_launch())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert 0.5 <= float(done.stdout) < 5.0  # the sleep before genfast's import is counted


def test_phases_are_the_intervals_between_marks(monkeypatch):
    phases = Phases()
    times = iter([1.5, 2.0, 2.25])
    monkeypatch.setattr("genfast.interface.startup.since_launch", lambda: next(times))
    for name in ("imports", "load", "first token"):
        phases.mark(name)
    assert phases.durations() == [("imports", 1.5), ("load", 0.5), ("first token", 0.25)]
    assert phases.summary() == "first token 2.2 s after launch (imports 1.5 s, load 0.5 s)"
    assert since_launch() > 0
