"""The diffusion recipe on tiny random diffusers pipelines: each step against the fp32 baseline
(explicit-softmax attention, eager), with the budgets of genfast/diffusion/recipe.py."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

pytest.importorskip("diffusers")

from genfast.diffusion.attention import fuse_qkv, unfuse_qkv
from genfast.diffusion.compiling import repeated_blocks
from genfast.diffusion.conv1x1 import Conv1x1AsLinear, conv1x1_to_linear, linears_to_conv1x1
from genfast.diffusion.feature_cache import DeepCacheUNet
from genfast.diffusion.group_norm import ChannelsLastGroupNorm
from genfast.diffusion.pipelines import call_kwargs, denoiser_of, initial_latents, tiny_pipeline
from genfast.diffusion.quality import psnr
from genfast.diffusion.recipe import RECIPE, DiffusionSettings, PipelineTarget, apply_recipe
from genfast.errors import UserError
from genfast.kernels.group_norm.ops import unavailable_reason as group_norm_unavailable
from genfast.platform import hardware
from genfast.quant.conv import DynamicInt8Conv2d, fewer_channels_than
from genfast.quant.linear import QuantLinear, narrower_than
from genfast.recipe import Target

FP32_EXACT = 1e-4  # max abs pixel difference (images in [0, 1]) for the fp32 rewrites
BF16_PSNR = 35.0  # dB; tiny models measure ~48-50
INT8_PSNR = 35.0  # dB; measured ~45-53
CACHE_PSNR = 30.0  # dB vs the same recipe uncached; measured ~50


def generate(pipe, size: int = 32, steps: int = 4) -> torch.Tensor:
    return pipe(
        "a red cat",
        num_inference_steps=steps,
        height=size,
        width=size,
        **call_kwargs(pipe),
        latents=initial_latents(pipe, size, size, seed=0),
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images.float()


def settings_for(step: str, dtype: str = "bfloat16") -> DiffusionSettings:
    return RECIPE.plan(step, Target(torch.device("cpu"), dtype)).settings


def eager(step: str, **changes) -> DiffusionSettings:
    """The cumulative recipe of `step` without compiling (compiles are tested apart: they are slow)."""
    return replace(settings_for(step), compile="none", dynamic_shapes=False, **changes)


@pytest.fixture(scope="module", params=["sd15", "sdxl", "pixart"])
def arch(request):
    return request.param


@pytest.fixture
def unet_arch(arch):
    if arch == "pixart":
        pytest.skip("DeepCache is for UNets (a transformer's feature cache: test_block_cache.py)")
    return arch


@pytest.fixture(scope="module")
def baseline(arch):
    return generate(apply_recipe(tiny_pipeline(arch), settings_for("baseline")))


def test_ladder_is_cumulative():
    assert settings_for("baseline") == DiffusionSettings()
    full = settings_for("feature-cache")
    assert full.feature_cache and not settings_for("dynamic-shapes").feature_cache
    assert (full.dtype, full.attention, full.compile) == ("bfloat16", "sdpa", "regional")
    assert full.channels_last and full.fuse_qkv and full.conv1x1_linear and full.dynamic_int8
    assert full.dynamic_shapes and not settings_for("regional-compile").dynamic_shapes
    assert settings_for("compile").compile == "full" and not settings_for("compile").dynamic_int8
    with pytest.raises(UserError, match="unknown step 'turbo' of the diffusion recipe"):
        settings_for("turbo")


@pytest.mark.parametrize("step", ["sdpa", "channels-last", "fused-qkv", "conv1x1-linear"])
def test_fp32_rewrites_are_exact(arch, baseline, step):
    image = generate(apply_recipe(tiny_pipeline(arch), eager(step, dtype="float32")))
    assert (image - baseline).abs().max().item() <= FP32_EXACT


@pytest.mark.parametrize("step", ["bf16", "conv1x1-linear"])
def test_bf16_steps_within_budget(arch, baseline, step):
    image = generate(apply_recipe(tiny_pipeline(arch), eager(step)))
    assert psnr(image, baseline) >= BF16_PSNR


def test_dynamic_int8_within_budget(arch, baseline):
    # The tiny models' linears are narrower than INT8_MIN_FEATURES: quantize them all here.
    pipe = apply_recipe(tiny_pipeline(arch), eager("dynamic-int8", int8_min_features=1))
    assert any(isinstance(m, QuantLinear) for m in denoiser_of(pipe).modules())
    assert psnr(generate(pipe), baseline) >= INT8_PSNR


def test_dynamic_fp8_replaces_dynamic_int8_where_the_gpu_has_fp8(monkeypatch):
    """On a GPU with fp8 tensor cores the dynamic-fp8 step takes dynamic-int8's place in every
    longer plan; elsewhere (an older GPU, a CPU, linears loaded in int8) it is left out without a
    word and int8 stays, and asked for by name it says why (its transform: test_transformers.py)."""
    from genfast.diffusion.recipe import PipelineTarget

    gpu = Target(torch.device("cuda"), "bfloat16")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for step in ("dynamic-fp8", "dynamic-shapes"):
        settings = RECIPE.plan(step, gpu).settings
        assert settings.dynamic_fp8 and not settings.dynamic_int8
    assert not RECIPE.plan("dynamic-int8", gpu).settings.dynamic_fp8
    quantized = PipelineTarget(torch.device("cuda"), "bfloat16", "FluxTransformer2DModel", quantized=True)
    with pytest.raises(UserError, match="quantized to int8 as loaded"):
        RECIPE.plan("dynamic-fp8", quantized)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    for target, why in ((gpu, "a GPU has 8.0"), (Target(torch.device("cpu"), "bfloat16"), "this is a cpu")):
        plan = RECIPE.plan("dynamic-shapes", target)
        assert plan.settings.dynamic_int8 and not plan.settings.dynamic_fp8
        assert "dynamic-fp8" not in dict(plan.skipped) and why in dict(plan.declined)["dynamic-fp8"]
        with pytest.raises(UserError, match=f"dynamic-fp8 cannot run here: .*{why}"):
            RECIPE.plan("dynamic-fp8", target)


def test_int8_conv_within_budget(arch, baseline):
    # Every convolution quantized (the tiny models are narrower than INT8_CONV_MIN_CHANNELS).
    pipe = apply_recipe(tiny_pipeline(arch), eager("int8-conv", int8_min_features=1, int8_conv_min_channels=1))
    assert any(isinstance(m, DynamicInt8Conv2d) for m in denoiser_of(pipe).modules())
    assert any(isinstance(m, DynamicInt8Conv2d) for m in pipe.vae.decoder.modules())
    assert psnr(generate(pipe), baseline) >= INT8_PSNR


def test_int8_conv_filter_is_a_shape_rule():
    keep = fewer_channels_than(128)
    assert keep("conv_in", torch.nn.Conv2d(4, 320, 3)) and not keep("any", torch.nn.Conv2d(128, 256, 3))


def test_cpu_kernel_steps_follow_the_recipe_rule_where_they_cannot_run(monkeypatch):
    """int8-conv and group-norm-kernel where their kernels are missing: left out of a longer recipe,
    with the reason; refused when asked for by name, and when their settings are applied."""
    import genfast.kernels.group_norm.ops as group_norm
    import genfast.quant.conv as conv

    monkeypatch.setattr(hardware, "fast_bf16_products", lambda: True)  # no bf16 note (test_transformers.py)
    monkeypatch.setattr(hardware, "has_amx_bf16", lambda: False)  # nor fused-attention's AMX note
    monkeypatch.setattr(conv, "int8_conv_unavailable_reason", lambda device: "no oneDNN here")
    monkeypatch.setattr(group_norm, "unavailable_reason", lambda: "no kernel here")
    plan = RECIPE.plan("regional-compile", Target(torch.device("cpu"), "bfloat16"))
    assert plan.skipped == (("int8-conv", "no oneDNN here"), ("group-norm-kernel", "no kernel here"))
    assert not plan.settings.int8_conv and not plan.settings.group_norm_kernel and plan.settings.dynamic_int8
    assert plan.messages() == [
        "step int8-conv left out: no oneDNN here",
        "step group-norm-kernel left out: no kernel here",
    ]
    with pytest.raises(UserError, match="step group-norm-kernel cannot run here: no kernel here"):
        RECIPE.plan("group-norm-kernel", Target(torch.device("cpu"), "bfloat16"))
    with pytest.raises(UserError, match="step int8-conv cannot run here: no oneDNN here"):
        apply_recipe(tiny_pipeline("sd15"), DiffusionSettings(int8_conv=True))


def test_group_norm_kernel_is_exact_in_fp32(arch, baseline):
    pipe = apply_recipe(
        tiny_pipeline(arch), eager("group-norm-kernel", dtype="float32", dynamic_int8=False, int8_conv=False)
    )
    norms = [
        m for model in (denoiser_of(pipe), pipe.vae) for m in model.modules() if isinstance(m, ChannelsLastGroupNorm)
    ]
    assert norms and all(type(m) is not torch.nn.GroupNorm for m in pipe.vae.modules())
    if group_norm_unavailable() is None:
        assert any(m.native for m in norms)
    assert (generate(pipe) - baseline).abs().max().item() <= FP32_EXACT


def test_int8_filter_is_a_shape_rule():
    keep = narrower_than(320)
    assert keep("any", torch.nn.Linear(320, 64)) and not keep("any", torch.nn.Linear(320, 1280))
    pipe = apply_recipe(tiny_pipeline("sd15"), eager("dynamic-int8"))  # default threshold: all tiny layers kept
    assert not any(isinstance(m, QuantLinear) for m in pipe.unet.modules())


def test_feature_cache(unet_arch, baseline):
    arch = unet_arch
    uncached = generate(apply_recipe(tiny_pipeline(arch), eager("conv1x1-linear", dtype="float32")))
    pipe = apply_recipe(
        tiny_pipeline(arch),
        eager("feature-cache", dtype="float32", dynamic_int8=False, int8_conv=False, group_norm_kernel=False),
    )
    assert isinstance(pipe.unet, DeepCacheUNet)
    cached = generate(pipe)
    assert CACHE_PSNR <= psnr(cached, uncached) < 100  # close, but the cache did skip work
    assert torch.equal(generate(pipe), cached)  # each pipeline call starts a new run (full first step)


def test_feature_cache_needs_a_denoiser_it_knows():
    """A UNet (DeepCache) or FLUX.1's, SD3's or PixArt's transformer (the block cache); another
    denoiser is refused by name, with the reason, and the step left out of a longer recipe."""
    target = PipelineTarget(torch.device("cpu"), "bfloat16", "SanaTransformer2DModel")
    with pytest.raises(UserError, match="this pipeline's denoiser is SanaTransformer2DModel"):
        RECIPE.plan("feature-cache", target)
    assert "left out: the feature cache" in RECIPE.describe(target)
    for denoiser in ("UNet2DConditionModel", "FluxTransformer2DModel", "PixArtTransformer2DModel"):
        target = PipelineTarget(torch.device("cpu"), "bfloat16", denoiser)
        assert RECIPE.plan("feature-cache", target).settings.feature_cache


def test_feature_cache_interval_1_is_the_unet(unet_arch):
    """Every step full: the cache's re-implementation of the UNet forward is the UNet's, bit for bit."""
    arch = unet_arch
    reference = generate(apply_recipe(tiny_pipeline(arch), eager("conv1x1-linear", dtype="float32")))
    pipe = apply_recipe(
        tiny_pipeline(arch),
        eager(
            "feature-cache",
            dtype="float32",
            dynamic_int8=False,
            int8_conv=False,
            group_norm_kernel=False,
            feature_cache_interval=1,
        ),
    )
    assert torch.equal(generate(pipe), reference)


def test_repeated_blocks_of_a_dit_without_declared_ones():
    """PixArt declares no `_repeated_blocks`: its transformer blocks are found as a ModuleList of
    one class (and not the lists nested inside them)."""
    transformer = tiny_pipeline("pixart").transformer
    assert list(repeated_blocks(transformer)) == list(transformer.transformer_blocks)


def test_fuse_unfuse_round_trip():
    pipe = tiny_pipeline("sd15")
    for model in (pipe.unet, pipe.vae):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        processors = {k: type(v) for k, v in model.attn_processors.items()}
        fuse_qkv(model)
        assert any(k.endswith("to_qkv.weight") for k in model.state_dict())
        unfuse_qkv(model)
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        assert {k: type(v) for k, v in model.attn_processors.items()} == processors


def test_conv1x1_swap_exact_and_reversible():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 24, 1)
    x = torch.randn(2, 16, 8, 8)
    swapped = Conv1x1AsLinear.from_conv(conv)
    torch.testing.assert_close(swapped(x), conv(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(swapped(x.to(memory_format=torch.channels_last)), conv(x), rtol=1e-5, atol=1e-6)
    pipe = tiny_pipeline("sd15")
    before = {k: v.clone() for k, v in pipe.vae.state_dict().items()}
    names = conv1x1_to_linear(pipe.vae)
    assert "post_quant_conv" in names and all(isinstance(pipe.vae.get_submodule(n), Conv1x1AsLinear) for n in names)
    assert sorted(linears_to_conv1x1(pipe.vae)) == sorted(names)
    after = pipe.vae.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_invalid_recipes_raise():
    pipe = tiny_pipeline("sd15")
    with pytest.raises(UserError, match="regional"):
        apply_recipe(pipe, DiffusionSettings(compile="full", feature_cache=True))
    with pytest.raises(UserError, match="fused QKV"):
        apply_recipe(pipe, DiffusionSettings(fuse_qkv=True))
    with pytest.raises(UserError, match="dynamic_shapes"):
        apply_recipe(pipe, DiffusionSettings(dynamic_shapes=True))
    before = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    with pytest.raises(UserError, match="both quantize the denoiser's linears: choose one"):
        apply_recipe(pipe, DiffusionSettings(dynamic_int8=True, dynamic_fp8=True))
    with pytest.raises(UserError, match=r"dynamic_fp8 cannot run here: .*this is a cpu"):
        apply_recipe(pipe, DiffusionSettings(dtype="bfloat16", dynamic_fp8=True))
    after = pipe.unet.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_every_step_has_settings():
    """Every step plans on this CPU, or is refused by name with its reason (dynamic-fp8: a GPU's)."""
    cpu = Target(torch.device("cpu"), "bfloat16")
    for step in RECIPE.names:
        if reason := RECIPE.unavailable(step, cpu):
            with pytest.raises(UserError, match=re.escape(reason)):
                settings_for(step)
        else:
            settings_for(step)
