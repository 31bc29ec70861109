"""genfast.ray.cluster's session handling, on a stand-in for the `ray` module (no cluster)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from genfast.ray.cluster import leaving_ray


def stand_in(initialized: bool) -> SimpleNamespace:
    """A `ray` module that records its shutdowns."""
    state = SimpleNamespace(initialized=initialized, shutdowns=0)

    def shutdown() -> None:
        state.shutdowns += 1
        state.initialized = False

    state.is_initialized = lambda: state.initialized
    state.shutdown = shutdown
    return state


def test_a_joined_session_is_left_when_the_command_returns_or_raises(monkeypatch):
    ray = stand_in(initialized=True)
    monkeypatch.setitem(sys.modules, "ray", ray)
    with leaving_ray():
        pass
    assert ray.shutdowns == 1
    ray.initialized = True
    with pytest.raises(KeyboardInterrupt), leaving_ray():
        raise KeyboardInterrupt
    assert ray.shutdowns == 2


def test_nothing_is_left_where_nothing_was_joined(monkeypatch):
    ray = stand_in(initialized=False)
    monkeypatch.setitem(sys.modules, "ray", ray)
    with leaving_ray():
        pass
    assert ray.shutdowns == 0
    monkeypatch.delitem(sys.modules, "ray")
    with leaving_ray():  # Ray never imported: nothing to do, and no import of it
        pass
    assert "ray" not in sys.modules
