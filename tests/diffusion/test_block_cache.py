"""The feature-cache step on transformer pipelines: the block residual cache
(genfast/diffusion/block_cache.py; first block by default, front and back blocks as set) on tiny
random FLUX.1, SD 3.5 and PixArt pipelines, against the same recipe uncached and cache-dit.
Budget: PSNR >= 30 dB against the uncached image (the step's, in genfast/diffusion/recipe.py);
threshold 0 is the uncached image exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("diffusers")

from torch._dynamo.utils import counters

from genfast.diffusion.block_cache import BlockCache, CachedBlock
from genfast.diffusion.pipelines import call_kwargs, initial_latents, tiny_pipeline
from genfast.diffusion.quality import psnr
from genfast.diffusion.recipe import RECIPE, DiffusionSettings, apply_recipe, pipeline_target
from genfast.errors import UserError
from genfast.quant.linear import QuantLinear
from genfast.recipe import Target

CACHE_PSNR = 30.0  # dB against the uncached image (tiny models measure 60-120: their later blocks add little)
# The tiny random models' first-block residual changes by 0.2-0.4 from step to step (a trained
# FLUX.1's by less: 0.08 is the step's default), so the tests skip at a threshold above that.
SKIPPING = 0.5
ALWAYS = 1e9  # every step that may be cached is
STEPS = 8
FP32 = DiffusionSettings(dtype="float32", attention="sdpa")


def generate(pipe, steps: int = STEPS, **options) -> torch.Tensor:
    text = {} if call_kwargs(pipe) else {"max_sequence_length": 32}  # T5's length (PixArt's is fixed)
    return pipe(
        "a red cat",
        num_inference_steps=steps,
        height=32,
        width=32,
        latents=initial_latents(pipe, 32, 32, seed=0),
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        **call_kwargs(pipe),
        **text,
        **options,
    ).images.float()


def cached(arch: str, threshold: float, **changes):
    """The fp32 SDPA pipeline with the block cache (interval 2 unless changed)."""
    changes = {"feature_cache": True, **changes}
    return apply_recipe(tiny_pipeline(arch), replace(FP32, block_cache_threshold=threshold, **changes))


def count_block_calls(transformer: BlockCache) -> list[int]:
    """A counter of the calls of the wrapped blocks themselves (skipped ones are not called)."""
    calls = [0]
    for module in transformer.modules():
        if isinstance(module, CachedBlock):
            module.denoiser.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.fixture(scope="module", params=["flux", "sd3", "pixart"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def uncached(arch):
    return generate(apply_recipe(tiny_pipeline(arch), FP32))


def test_threshold_zero_is_the_uncached_pipeline(arch, uncached):
    pipe = cached(arch, 0.0)
    assert isinstance(pipe.transformer, BlockCache)
    assert torch.equal(generate(pipe), uncached)
    assert pipe.transformer.skipped == 0 and pipe.transformer.calls == STEPS


def test_skipping_calls_fewer_blocks_within_budget(arch, uncached):
    pipe = cached(arch, SKIPPING)
    blocks = sum(isinstance(m, CachedBlock) for m in pipe.transformer.modules())
    calls = count_block_calls(pipe.transformer)
    image = generate(pipe)
    skipped = pipe.transformer.skipped
    assert 0 < skipped <= STEPS // 2  # at most every other step (interval 2), never the first
    assert calls[0] == STEPS * blocks - skipped * (blocks - 1)
    assert CACHE_PSNR <= psnr(image, uncached) < 200  # close, and not the uncached image


def deeper(pipe, blocks: int):
    """`pipe` with its transformer rebuilt with `blocks` blocks (FLUX.1: double-stream ones added)."""
    transformer = pipe.transformer
    singles = transformer.config.get("num_single_layers", 0)
    torch.manual_seed(1)
    pipe.transformer = type(transformer).from_config({**transformer.config, "num_layers": blocks - singles})
    return pipe.transformer.eval()


@pytest.mark.parametrize(("front", "back"), [(2, 1), (1, 2)])
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_front_and_back_blocks(family, front, back):
    """FnBn: the front blocks and the back blocks run on every step, only the ones between are
    skipped; threshold 0 is the uncached image exactly, skipping stays within budget."""
    base = tiny_pipeline(family)
    deeper(base, 5)
    uncached = generate(apply_recipe(base, FP32))
    changes = {"block_cache_front": front, "block_cache_back": back}
    pipe = tiny_pipeline(family)
    deeper(pipe, 5)
    pipe = apply_recipe(pipe, replace(FP32, feature_cache=True, block_cache_threshold=0.0, **changes))
    assert torch.equal(generate(pipe), uncached)
    pipe.transformer._shared.threshold = SKIPPING
    calls = count_block_calls(pipe.transformer)
    image = generate(pipe)
    skipped = pipe.transformer.skipped
    assert 0 < skipped <= STEPS // 2
    assert calls[0] == STEPS * 5 - skipped * (5 - front - back)
    assert CACHE_PSNR <= psnr(image, uncached) < 200


class ConstantResidual(torch.nn.Module):
    """A FLUX.1 block that adds the same residual to both streams whatever its input: skipping it
    and adding the residual it added on the last full step is then exact."""

    def __init__(self, hidden: int, text: int) -> None:
        super().__init__()
        self.image = torch.nn.Parameter(torch.randn(hidden))
        self.text = torch.nn.Parameter(torch.randn(text))

    def forward(self, hidden_states, encoder_hidden_states, temb=None, image_rotary_emb=None, **kwargs):
        return encoder_hidden_states + self.text, hidden_states + self.image


def test_cached_steps_add_both_streams_residuals_before_the_back_blocks():
    """F1B1 on FLUX.1 whose skipped blocks add constant residuals: every cached step is then the
    uncached step exactly (to rounding), which holds only if the text stream's residual reaches the
    back block too (a single-stream block, which attends over both streams)."""

    def pipeline():
        pipe = tiny_pipeline("flux")
        transformer = deeper(pipe, 4)  # double, double, single, single
        width = transformer.inner_dim
        transformer.transformer_blocks[1] = ConstantResidual(width, width)
        transformer.single_transformer_blocks[0] = ConstantResidual(width, width)
        return pipe

    uncached = generate(apply_recipe(pipeline(), FP32))
    settings = replace(FP32, feature_cache=True, block_cache_threshold=ALWAYS, block_cache_back=1)
    pipe = apply_recipe(pipeline(), settings)
    image = generate(pipe)
    assert pipe.transformer.skipped == STEPS // 2
    assert (image - uncached).abs().max().item() <= 1e-5
    pipe.transformer._caches.clear()
    pipe.transformer._shared.back = 0  # the text stream's residual no longer kept: the back block differs
    assert (generate(pipe) - uncached).abs().max().item() > 1e-3


def test_the_cache_needs_a_block_between_front_and_back():
    with pytest.raises(ValueError, match="needs a block to skip"):
        apply_recipe(tiny_pipeline("flux"), replace(FP32, feature_cache=True, block_cache_front=2, block_cache_back=2))
    with pytest.raises(UserError, match="block_cache_front must be >= 1"):
        apply_recipe(tiny_pipeline("flux"), replace(FP32, feature_cache=True, block_cache_front=0))


def test_each_pipeline_call_starts_a_new_run(arch):
    """The run starts at set_timesteps: a second call repeats the first (the first step of each run
    runs every block), and a call with another step count caches by its own steps."""
    pipe = cached(arch, SKIPPING)
    calls = count_block_calls(pipe.transformer)
    first = generate(pipe)
    per_call = calls[0]
    assert torch.equal(generate(pipe), first) and calls[0] == 2 * per_call
    generate(pipe, steps=2)  # warm-up step, then at most one cached
    assert pipe.transformer.calls == 2 * STEPS + 2


def test_cached_steps_in_a_row_and_warmup():
    """interval 3: up to two cached steps in a row; warm-up 4: the first four steps run whole."""
    pipe = cached("flux", ALWAYS, feature_cache_interval=3)
    generate(pipe)
    assert pipe.transformer.skipped == 5  # steps 1, 2, 4, 5, 7 of 0-7
    pipe = cached("flux", ALWAYS, feature_cache_interval=3, block_cache_warmup=4)
    generate(pipe)
    assert pipe.transformer.skipped == 3  # steps 4, 5, 7


def test_the_step_takes_the_block_cache_on_transformers(arch):
    pipe = tiny_pipeline(arch)
    plan = RECIPE.plan("feature-cache", pipeline_target(pipe, "bfloat16"))
    assert plan.settings.feature_cache and plan.settings.block_cache_threshold == 0.08
    eager = replace(plan.settings, compile="none", dynamic_shapes=False, int8_min_features=1)
    pipe = apply_recipe(pipe, eager)
    assert isinstance(pipe.transformer, BlockCache)
    assert any(isinstance(m, QuantLinear) for m in pipe.transformer.modules())  # composes with int8
    if arch != "pixart":  # fused QKV: diffusers' fused projections on FLUX.1's and SD3's attention
        assert any(name.endswith(".to_qkv") for name, _ in pipe.transformer.named_modules())
    generate(pipe, steps=2)


def test_controlnet_residuals_are_refused():
    pipe = cached("flux", SKIPPING)
    with pytest.raises(ValueError, match="controlnet_block_samples"):
        pipe.transformer(torch.zeros(1), controlnet_block_samples=[torch.zeros(1)])


def test_true_cfg_contexts_keep_a_cache_each():
    """FluxPipeline's true classifier-free guidance calls the transformer twice a step, under
    cache_context("cond") and ("uncond"): each keeps its own cache (2 calls a step, each context
    skipping as a run of its own), and threshold 0 is still the uncached pipeline."""
    kwargs = {"negative_prompt": "blue", "true_cfg_scale": 2.0}
    reference = generate(apply_recipe(tiny_pipeline("flux"), FP32), **kwargs)
    assert torch.equal(generate(cached("flux", 0.0), **kwargs), reference)
    pipe = cached("flux", ALWAYS)
    image = generate(pipe, **kwargs)
    assert pipe.transformer.calls == 2 * STEPS and pipe.transformer.skipped == STEPS  # each context: 1, 3, 5, 7
    assert psnr(image, reference) >= CACHE_PSNR


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_with_regional_compile(family):
    """The whole feature-cache recipe (bf16, fused QKV, dynamic int8, the blocks regionally compiled
    with symbolic sizes): the blocks stay compiled inside the cache's wrappers, threshold 0 is the
    same pipeline uncached, skipping stays within budget and compiles nothing more."""
    settings = replace(
        RECIPE.plan("feature-cache", Target(torch.device("cpu"), "bfloat16")).settings,
        int8_min_features=1,
        int8_conv=False,
        group_norm_kernel=False,
    )
    pipe = apply_recipe(tiny_pipeline(family), replace(settings, block_cache_threshold=0.0))
    blocks = [m.denoiser for m in pipe.transformer.modules() if isinstance(m, CachedBlock)]
    assert blocks and all("forward" in vars(b) for b in blocks)  # compiled in place (with symbolic sizes)
    exact = generate(pipe)
    graphs = counters["stats"]["unique_graphs"]
    shared = pipe.transformer._shared
    shared.threshold = SKIPPING
    calls = count_block_calls(pipe.transformer)
    image = generate(pipe)
    assert pipe.transformer.skipped > 0 and calls[0] < STEPS * len(blocks)
    assert psnr(image, exact) >= CACHE_PSNR
    assert counters["stats"]["unique_graphs"] == graphs  # the cached steps compile nothing
    shared.threshold = 0.0
    assert torch.equal(generate(pipe), exact)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_against_cache_dit(family):
    """Where cache-dit is installed: its DBCache configured as genfast's block cache (one front
    block, none behind: F1B0; the same threshold, warm-up and cached steps in a row) on diffusers'
    own pipeline skips the same steps, and the images agree (fp32: max abs diff <= 1e-5)."""
    for threshold in (0.0, SKIPPING):
        expected, cached_steps = with_cache_dit(tiny_pipeline(family), 1, 0, threshold)
        pipe = cached(family, threshold)
        assert (generate(pipe) - expected).abs().max().item() <= 1e-5
        assert pipe.transformer.skipped == cached_steps == (0 if threshold == 0 else 4)


def with_cache_dit(pipe, front: int, back: int, threshold: float) -> tuple[torch.Tensor, int]:
    """The image of diffusers' own `pipe` under cache-dit's DBCache configured as genfast's block
    cache (warm-up 1, at most one cached step in a row), and how many steps it cached."""
    cache_dit = pytest.importorskip("cache_dit")
    config = cache_dit.DBCacheConfig(
        Fn_compute_blocks=front,
        Bn_compute_blocks=back,
        residual_diff_threshold=threshold,
        max_warmup_steps=1,
        max_continuous_cached_steps=1,
    )
    cache_dit.enable_cache(pipe, cache_config=config)
    image = generate(pipe)
    return image, len(cache_dit.summary(pipe, logging=False)[-1].cached_steps)


@pytest.mark.parametrize(("front", "back"), [(2, 1), (1, 2)])
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_front_and_back_blocks_against_cache_dit(family, front, back):
    """Where cache-dit is installed: its DBCache with the same front and back blocks (Fn, Bn) skips
    the same steps and draws the same image (fp32: max abs diff <= 1e-5) on a 5-block transformer."""
    reference = tiny_pipeline(family)
    deeper(reference, 5)
    expected, cached_steps = with_cache_dit(reference, front, back, SKIPPING)
    pipe = tiny_pipeline(family)
    deeper(pipe, 5)
    changes = {"block_cache_front": front, "block_cache_back": back}
    pipe = apply_recipe(pipe, replace(FP32, feature_cache=True, block_cache_threshold=SKIPPING, **changes))
    assert (generate(pipe) - expected).abs().max().item() <= 1e-5
    assert pipe.transformer.skipped == cached_steps > 0
