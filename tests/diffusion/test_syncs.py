"""No host-device synchronization inside the denoiser: nothing genfast puts in the loop (SDPA,
fused QKV, 1x1-conv linears, dynamic int8, the UNets' feature cache) reads a tensor's value on the
host, but the transformers' block cache, which reads one per step past its warm-up (its decision
which blocks run: genfast/diffusion/block_cache.py says why).

Such a read is `aten::_local_scalar_dense` (`.item()`, `bool(t)`, `float(t)`), a sync on CUDA;
on the CPU the same op shows where one would be, so the count is checked here on every
architecture (a compiled fullgraph denoiser cannot contain one: it would be a graph break).
Outside the denoiser, diffusers' Euler scheduler compares sigmas it keeps on the CPU (no sync)
and looks up the first step's index once per image; PixArt's T5 mask is checked once per prompt.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("diffusers")

from genfast.diffusion.pipelines import DenoiserWrapper, call_kwargs, denoiser_name, denoiser_of, tiny_pipeline
from genfast.diffusion.recipe import RECIPE, apply_recipe
from genfast.recipe import Target

SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class ScalarReads(TorchDispatchMode):
    """Counts host reads of tensor values while `active` (set around the denoiser's calls only)."""

    def __init__(self) -> None:
        super().__init__()
        self.active, self.inside, self.total = False, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SCALAR_READS:
            self.total += 1
            self.inside += self.active
        return func(*args, **(kwargs or {}))


class Watched(DenoiserWrapper):
    def __init__(self, denoiser: torch.nn.Module, reads: ScalarReads) -> None:
        super().__init__(denoiser)
        self.reads, self.calls = reads, 0

    def forward(self, *args, **kwargs):
        self.reads.active, self.calls = True, self.calls + 1
        try:
            return self.denoiser(*args, **kwargs)
        finally:
            self.reads.active = False


@pytest.mark.parametrize(
    "arch, step", [("sd15", "feature-cache"), ("sdxl", "feature-cache"), ("pixart", "dynamic-int8")]
)
def test_no_host_reads_inside_the_denoiser(arch, step):
    recipe = replace(
        RECIPE.plan(step, Target(torch.device("cpu"), "bfloat16")).settings,
        compile="none",
        dynamic_shapes=False,
        int8_min_features=1,
    )
    pipe = apply_recipe(tiny_pipeline(arch), recipe)
    reads = ScalarReads()
    watched = Watched(denoiser_of(pipe), reads)
    setattr(pipe, denoiser_name(pipe), watched)
    with reads:
        pipe("a red cat", num_inference_steps=4, height=32, width=32, output_type="pt", **call_kwargs(pipe))
    assert watched.calls == 4
    assert reads.total > 0  # the counter sees the scheduler's and text encoder's reads
    assert reads.inside == 0


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_the_block_cache_reads_one_value_a_step_past_its_warmup(arch):
    recipe = replace(
        RECIPE.plan("feature-cache", Target(torch.device("cpu"), "bfloat16")).settings,
        compile="none",
        dynamic_shapes=False,
    )
    pipe = apply_recipe(tiny_pipeline(arch), recipe)
    cache = denoiser_of(pipe)
    reads = ScalarReads()
    watched = Watched(cache, reads)
    setattr(pipe, denoiser_name(pipe), watched)
    with reads:
        pipe("a red cat", num_inference_steps=4, height=32, width=32, max_sequence_length=32, output_type="pt")
    # The tiny models' first-block residual changes by more than the default threshold a step:
    # nothing is cached, and steps 1-3 each read their one value (the warm-up step 0 none).
    assert cache.skipped == 0 and reads.inside == 3
