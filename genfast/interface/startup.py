"""What a user waits for: seconds since the process was launched, and the start-up phases.

Time to first token as a user sees it runs from launching the command, not from the start of
prefill: the interpreter, the imports, loading the model and compiling all come before. Linux
gives the process's start time (/proc/self/stat, in clock ticks since boot); elsewhere the clock
starts when genfast is first imported, which misses only the interpreter's own start-up.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_IMPORTED_AT = time.monotonic()


def proc_stat(pid: int | str = "self") -> list[str] | None:
    """The fields of /proc/PID/stat from the third (state) on, or None where /proc does not have
    the process: the command name before them, in parentheses, may hold spaces."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int | str = "self") -> str | None:
    """When process `pid` started, in clock ticks after boot (field 22; Linux), or None."""
    fields = proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def _launched_at() -> float:
    """The process start on time.monotonic()'s clock (which counts from boot on Linux)."""
    try:
        started = int(start_ticks() or "") / os.sysconf("SC_CLK_TCK")
        booted_ago = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT
    return time.monotonic() - (booted_ago - started)


_LAUNCHED_AT = _launched_at()


def since_launch() -> float:
    """Seconds since this process was launched."""
    return time.monotonic() - _LAUNCHED_AT


class Phases:
    """Named start-up phases, each ending at the moment it is marked: e.g. imports, load,
    compile, first token. `summary()` gives them as one line for stats."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> float:
        """End the phase `name` now; returns seconds since launch."""
        now = since_launch()
        self.marks.append((name, now))
        return now

    def durations(self) -> list[tuple[str, float]]:
        previous, out = 0.0, []
        for name, at in self.marks:
            out.append((name, at - previous))
            previous = at
        return out

    def summary(self) -> str:
        """e.g. 'first token 2.4 s after launch (imports 1.9 s, load 0.4 s, prefill 0.1 s)'."""
        if not self.marks:
            return ""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.durations()[:-1])
        last, at = self.marks[-1]
        return f"{last} {at:.1f} s after launch" + (f" ({parts})" if parts else "")
