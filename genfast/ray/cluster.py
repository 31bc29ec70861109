"""Joining a Ray cluster, or saying how to get Ray."""

from __future__ import annotations

import os
from typing import Any

from genfast.errors import UserError


def require_ray() -> Any:
    """The `ray` module, or a UserError that says how to get it."""
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise UserError("--ray needs Ray Data: pip install 'genfast[ray]'") from e
    return ray


def connect(address: str | None) -> Any:
    """Join the cluster at `address` ("auto": the one this machine belongs to; None: a local one
    started for this process) unless this process already has; returns the `ray` module."""
    ray = require_ray()
    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports to Ray's servers
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except ConnectionError as e:
            raise UserError(f"could not join the Ray cluster at {address}: {e}") from e
    return ray
