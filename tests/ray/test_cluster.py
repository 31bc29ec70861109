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


@pytest.mark.parametrize("joined", [True, False])
def test_ray_is_left_when_the_command_ends_where_it_was_joined(monkeypatch, joined):
    ray = stand_in(initialized=joined)
    monkeypatch.setitem(sys.modules, "ray", ray)
    with leaving_ray():
        pass
    assert ray.shutdowns == int(joined)


def test_a_command_that_raises_leaves_ray_too(monkeypatch):
    ray = stand_in(initialized=True)
    monkeypatch.setitem(sys.modules, "ray", ray)
    with pytest.raises(KeyboardInterrupt), leaving_ray():
        raise KeyboardInterrupt
    assert ray.shutdowns == 1


def test_nothing_is_imported_where_ray_never_was(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    with leaving_ray():
        pass
    assert "ray" not in sys.modules
