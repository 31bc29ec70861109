"""The suite on several pytest-xdist workers: tests marked `alone` (they react to what other
processes keep busy) run while no other worker runs a test."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def share_of_the_machine(item: pytest.Item) -> Iterator[None]:
    """Holds `item`'s share of the machine for its setup, call and teardown (module fixtures'
    too): the whole machine for an `alone` test, otherwise a share beside the other workers' tests.

    A readers-writer lock over two files of the run's folder: a test takes the gate, then the
    room (shared, or exclusive for `alone`); an `alone` test keeps the gate while it waits, so
    no worker starts a test meanwhile. Only on an xdist worker (`workerinput`): a plain pytest
    that a test starts inherits xdist's variables and must not wait on its parent."""
    if not hasattr(item.config, "workerinput"):
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    folder = Path(item.config.option.basetemp).parent  # every worker's basetemp is in the run's own folder
    with open(folder / "gate.lock", "a") as gate, open(folder / "room.lock", "a") as room:  # closing unlocks
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
