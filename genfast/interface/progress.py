"""A wait the user can see: a slow step (a first compile) never sits silent."""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO


class Ticker:
    """Shows that `message` is under way. On a terminal the line is redrawn each second with the
    seconds elapsed; elsewhere (a log file, a pipe) it is written once. Either way it ends with
    how long it took."""

    def __init__(self, message: str, stream: TextIO | None = None, every_s: float = 1.0) -> None:
        self.message = message
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.seconds = 0.0
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Ticker:
        self._start = time.perf_counter()
        if self.stream.isatty():
            self._thread = threading.Thread(target=self._redraw, daemon=True)
            self._thread.start()
        else:
            self.stream.write(f"{self.message} ...\n")
            self.stream.flush()
        return self

    def _redraw(self) -> None:
        while not self._stop.wait(self.every_s):
            self.stream.write(f"\r{self.message} ... {time.perf_counter() - self._start:.0f} s")
            self.stream.flush()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.seconds = time.perf_counter() - self._start
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        ending = "done" if kind is None else "failed"
        prefix = "\r" if self._thread is not None else ""
        self.stream.write(f"{prefix}{self.message} ... {ending} in {self.seconds:.1f} s\n")
        self.stream.flush()


class Progress:
    """Progress through `total` items ("frames"), with the rate: on a terminal one line redrawn
    at most every `every_s` seconds; elsewhere a line at each tenth of the way."""

    def __init__(self, total: int, what: str, stream: TextIO | None = None, every_s: float = 0.5) -> None:
        self.total, self.what = max(total, 1), what
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.done = 0
        self._start = time.perf_counter()
        self._shown = 0.0
        self._next_tenth = 1
        self._tty = self.stream.isatty()

    @property
    def rate(self) -> float:
        """Items per second so far."""
        return self.done / max(time.perf_counter() - self._start, 1e-9)

    def line(self) -> str:
        text = f"{self.what} {self.done}/{self.total} ({self.rate:.2f} {self.what}/s"
        if 0 < self.done < self.total:
            text += f", ~{_duration((self.total - self.done) / self.rate)} left"
        return text + ")"

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self._tty:
            if now - self._shown >= self.every_s or self.done >= self.total:
                self.stream.write(f"\r{self.line()}")
                self.stream.flush()
                self._shown = now
        elif self.done * 10 >= self._next_tenth * self.total:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
            self._next_tenth = self.done * 10 // self.total + 1

    def finish(self) -> None:
        if self._tty:
            self.stream.write(f"\r{self.line()}\n")
            self.stream.flush()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
