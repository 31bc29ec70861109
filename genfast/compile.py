"""torch.compile settings per device, passed per call (no global inductor config is changed).

CPU: `freezing` turns weights into constants so inductor can pre-pack them for oneDNN and fold
weight-only ops; measured on SmolLM2-135M it is what makes compiled decode beat eager (see
docs/performance.md). CUDA: CUDA graphs remove the per-kernel launch cost of decode.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
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
    use_persistent_cache()
    return torch.compile(fn, fullgraph=True, dynamic=False, options=inductor_options(device, decode=decode))


def use_persistent_cache() -> Path:
    """Keep inductor's compiled artifacts under GENFAST_HOME (not /tmp), unless the user chose a place."""
    cache = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(genfast_home() / "inductor")))
    return cache
