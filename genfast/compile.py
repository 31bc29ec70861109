"""torch.compile settings per device, passed per call (no global inductor config is changed).

CPU: `freezing` (measured 8.7 vs 9.5 ms per SmolLM2 decode step, single runs, within this
host's noise). Weights stay graph inputs: with dynamo's `prepare_freezing` they become constants
and inductor folds their fp32 upcast, doubling the bytes each decode step reads (57 vs ~100 tok/s).
`cpp_wrapper` and `max_autotune` were measured and did not help (docs/performance.md).
CUDA: CUDA graphs remove the per-kernel launch cost of decode.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from genfast.hub import genfast_home


def inductor_options(device: torch.device | str, *, decode: bool) -> dict[str, Any]:
    device = torch.device(device)
    if device.type == "cuda":
        return {"triton.cudagraphs": decode, "coordinate_descent_tuning": True}
    return {"freezing": True}


def compile_fn(fn: Callable, device: torch.device | str, *, decode: bool) -> Callable:
    """Compile one step function (fullgraph: a graph break is a bug, not a slowdown)."""
    return torch.compile(fn, fullgraph=True, dynamic=False, options=inductor_options(device, decode=decode))


def use_persistent_cache() -> None:
    """Keep inductor's compiled artifacts under GENFAST_HOME (not /tmp), unless the user chose a
    place. Inductor reads the variable once, so this must run before anything compiles."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(genfast_home() / "inductor"))
