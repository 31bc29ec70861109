"""torch.compile settings per device, passed per call (no global inductor config is changed).

CPU: `freezing`. Weights stay graph inputs: with dynamo's `prepare_freezing` they would become
constants and inductor would fold their fp32 upcast, doubling the bytes each decode step reads.
`max_autotune` does not help on the CPU. `cpp_wrapper` (the graph's calls made from C++, not
Python) speeds up the decode of models whose linears are genfast's native quantized kernels (a
hundred extern kernel calls a step), where it pays for its doubled compile time; so it is used for
those only, and not with tensor parallelism (untested there). CPU decode also drops inductor's
input size asserts. The measurements behind each choice: docs/notes.md.
CUDA: CUDA graphs remove the per-kernel launch cost of decode; coordinate-descent tuning for decode only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.torch_version import TorchVersion

from genfast.storage.paths import genfast_home, inductor_dir

# CUDA graphs recorded or replayed on a thread that Python started (the server's scheduler) fail
# in torch before 2.13: cudagraph trees kept their state only for the main thread and autograd's
# (pytorch/pytorch#123177). Seen with torch 2.11 on an H200: every served request ended after its
# first token.
CUDA_GRAPHS_IN_THREADS = TorchVersion(torch.__version__) >= (2, 13)


def inductor_options(
    device: torch.device | str,
    *,
    decode: bool,
    native_kernels: bool = False,
    cuda_graphs: bool = True,
    max_autotune: bool = False,
) -> dict[str, Any]:
    """`native_kernels`: the compiled model's linears call genfast's native quantized kernels.
    `cuda_graphs`: a CUDA decode step replays a CUDA graph (False: launches its kernels).
    `max_autotune` (CUDA): inductor times its Triton GEMM templates, with their pointwise epilogues
    fused, against cuBLAS for every matrix product's shape and keeps the fastest: minutes more
    compile for compute-bound graphs (segment-anything-fast's encoder recipe). The CPU ignores it
    (measured no help there)."""
    device = torch.device(device)
    if device.type == "cuda":
        # Coordinate-descent tuning of the generated kernels' block sizes is for decode, whose
        # every kernel is a small memory-bound one; other steps are mostly cuBLAS GEMMs and
        # attention (prefill's compile was ~100 s of a 7B row's ~250 s on an H100, tuned).
        options = {"triton.cudagraphs": decode and cuda_graphs, "coordinate_descent_tuning": decode}
        return {**options, "max_autotune": True} if max_autotune else options
    options: dict[str, Any] = {"freezing": True}
    if decode:
        # Inductor's checks of every input's sizes and strides (~400 a SmolLM2 step, in Python):
        # genfast builds the inputs and the guards checked them on the first call; they cost a
        # few percent of a small model's step.
        options["size_asserts"] = False
    if decode and native_kernels and not (dist.is_available() and dist.is_initialized()):
        options["cpp_wrapper"] = True
    return options


def compile_fn(
    fn: Callable,
    device: torch.device | str,
    *,
    decode: bool,
    model: nn.Module | None = None,
    cuda_graphs: bool = True,
    max_autotune: bool = False,
) -> Callable:
    """Compile one step function (fullgraph: a graph break is a bug, not a slowdown) of `model`."""
    from genfast.quant.linear import uses_native_kernels

    native = model is not None and uses_native_kernels(model)
    options = inductor_options(
        device, decode=decode, native_kernels=native, cuda_graphs=cuda_graphs, max_autotune=max_autotune
    )
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options)


def use_persistent_cache() -> None:
    """Keep inductor's compiled artifacts under GENFAST_HOME (not /tmp), one folder per kind of CPU
    (`hardware.code_target`: inductor's keys do not tell CPUs apart), unless the user chose a
    place. Inductor reads the variable at each use but writes its default into it on the first
    (some imports do that), so that default counts as unchosen."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from genfast.platform import hardware

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        kept = inductor_dir() / hardware.code_target()
        try:
            kept.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # e.g. a read-only home: compile into inductor's temporary folder
            kept = Path(default_cache_dir()) / hardware.code_target()
            print(
                f"genfast: cannot write {genfast_home()} ({exc.strerror or exc}): compiled code goes to {kept} "
                "and may not last; GENFAST_HOME names another folder",
                file=sys.stderr,
            )
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(kept)
