"""Joining a Ray cluster, or saying how to get Ray."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
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


@contextmanager
def leaving_ray() -> Iterator[None]:
    """For a command's whole run: this process leaves Ray (`ray.shutdown`) when the block ends, if
    it joined, whether the block returned or raised.

    Left to itself, Ray leaves from an atexit hook while the interpreter is tearing its modules
    down around Ray's core worker; a `segment --ray` driver whose lost actor had been restarted
    was seen to crash there with SIGSEGV after all its files were written, so that its exit
    status said it had failed."""
    try:
        yield
    finally:
        ray = sys.modules.get("ray")  # not imported: never joined
        if ray is not None and ray.is_initialized():
            ray.shutdown()


def map_through(
    ray: Any,
    rows: Any,
    model_class: type,
    model_kwargs: dict[str, Any],
    call_kwargs: dict[str, Any],
    concurrency: int,
    batch_size: int,
    cpus_per_actor: float,
) -> Any:
    """The Dataset `rows` mapped through `concurrency` actors of `model_class(**model_kwargs)` (a
    genfast Ray Data callable class; `call_kwargs`: its `__call__`'s keywords), each reserving
    `cpus_per_actor` CPUs, `batch_size` rows a call (lazily: nothing runs until it is read)."""
    return rows.map_batches(
        model_class,
        fn_constructor_kwargs=model_kwargs,
        fn_kwargs=call_kwargs,
        compute=ray.data.ActorPoolStrategy(size=concurrency),
        batch_size=batch_size,
        batch_format="numpy",
        num_cpus=cpus_per_actor,
    )


def write_jsonl(mapped: Any, target: Path) -> int:
    """Run the Dataset `mapped` (`map_through`'s), its rows written as JSONL files into the folder
    `target`. Returns the rows written."""
    # Writing takes no CPU of its own: the actors hold the CPUs (with every CPU of the cluster in
    # an actor, a writer that wanted one would wait for ever).
    mapped.write_json(str(target.resolve()), ray_remote_args={"num_cpus": 0})
    return sum(1 for path in target.glob("*.json") for line in path.read_text().splitlines() if line.strip())
