"""The diffusion recipe on the transformer pipelines, FLUX.1 (FluxPipeline) and Stable Diffusion 3.5
(StableDiffusion3Pipeline), tiny and random: genfast's baseline against diffusers' own pipeline,
each step of the ladder against the fp32 baseline within the budgets of genfast/diffusion/recipe.py,
compiled forms (slow) and `genfast imagine` on a saved tiny Flux (the feature cache: test_block_cache.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

from PIL import Image
from torch._dynamo.utils import counters

from genfast import cli
from genfast.diffusion.attention import FluxAttention, JointAttention, fuse_qkv, unfuse_qkv
from genfast.diffusion.conv1x1 import Conv1x1AsLinear
from genfast.diffusion.generator import check_size
from genfast.diffusion.group_norm import ChannelsLastGroupNorm
from genfast.diffusion.pipelines import DenoiserWrapper, initial_latents, native_size, size_multiple, tiny_pipeline
from genfast.diffusion.quality import psnr
from genfast.diffusion.recipe import RECIPE, DiffusionSettings, _quantize_dynamic_fp8, apply_recipe, pipeline_target
from genfast.errors import UserError
from genfast.nn import Fp32ProductsLinear
from genfast.platform import hardware
from genfast.quant.conv import DynamicInt8Conv2d
from genfast.quant.fp8 import Fp8DynamicLinear
from genfast.quant.linear import QuantLinear
from genfast.recipe import Target

CPU_BF16 = Target(torch.device("cpu"), "bfloat16")
REFERENCE_EXACT = 1e-5  # max abs pixel difference, genfast's baseline vs diffusers' pipeline (measured ~1e-6)
FP32_EXACT = 1e-4  # the recipe's budget for its fp32 rewrites (measured ~1e-6)
STEP_PSNR = 35.0  # dB: the bf16, dynamic-int8 and int8-conv budgets (measured 41-47 here)
FP8_PSNR = 30.0  # dB: the dynamic-fp8 step's budget (measured 34-44; e4m3 keeps 3 mantissa bits)
COMPILED_BF16_PSNR = 35.0  # dB, compiled vs eager with the same steps
TEXT_TOKENS = 32  # T5 tokens of a prompt (the pipelines' defaults, 512 and 256, only make the tests slower)
# The steps that run eagerly, in ladder order; compile, regional-compile and dynamic-shapes are
# tested apart (slow).
EAGER_STEPS = ["bf16", "sdpa", "channels-last", "fused-qkv", "fused-attention", "conv1x1-linear", "dynamic-int8",
               "int8-conv", "group-norm-kernel"]  # fmt: skip
# fused-attention in fp32: SDPA on these tiny sequences with either kernel (test_attention_kernel.py).
FP32_EXACT_STEPS = ["sdpa", "channels-last", "fused-qkv", "fused-attention", "conv1x1-linear", "group-norm-kernel"]


def generate(pipe, size: tuple[int, int] = (32, 32), steps: int = 3, seed: int = 0) -> torch.Tensor:
    height, width = size
    return pipe(
        "a red cat",
        num_inference_steps=steps,
        height=height,
        width=width,
        latents=initial_latents(pipe, height, width, seed=seed),
        generator=torch.Generator().manual_seed(seed),
        max_sequence_length=TEXT_TOKENS,
        output_type="pt",
    ).images.float()


def eager(step: str, **changes) -> DiffusionSettings:
    """The cumulative recipe up to `step` without compiling, every layer of the tiny models
    quantized by the int8 steps (they are narrower than the real-size thresholds)."""
    if reason := RECIPE.unavailable(step, CPU_BF16):
        pytest.skip(f"{step} cannot run here: {reason}")
    everything = {"compile": "none", "dynamic_shapes": False, "int8_min_features": 1, "int8_conv_min_channels": 1}
    return replace(RECIPE.plan(step, CPU_BF16).settings, **{**everything, **changes})


@pytest.fixture(scope="module", params=["flux", "sd3"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def baseline(arch):
    return generate(apply_recipe(tiny_pipeline(arch), DiffusionSettings()))


def test_baseline_is_diffusers_own_pipeline(arch, baseline):
    """genfast's baseline (explicit-softmax attention, genfast's initial latents: packed 2x2 for
    Flux) against the unmodified diffusers pipeline drawing its own noise from the same seed."""
    reference = tiny_pipeline(arch)
    image = reference(
        "a red cat",
        num_inference_steps=3,
        height=32,
        width=32,
        generator=torch.Generator().manual_seed(0),
        max_sequence_length=TEXT_TOKENS,
        output_type="pt",
    ).images.float()
    assert (image - baseline).abs().max().item() <= REFERENCE_EXACT


def test_attention_steps_choose_the_implementation(arch):
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0, JointAttnProcessor2_0

    pipe = apply_recipe(tiny_pipeline(arch), DiffusionSettings())
    vae_processors = {type(p) for p in pipe.vae.attn_processors.values()}
    processors = pipe.transformer.attn_processors.values()
    if arch == "flux":  # diffusers' attention backends, set per module
        assert {p._attention_backend.value for p in processors} == {"_native_math"}
    else:
        assert {type(p).__name__ for p in processors} == {"MathJointAttnProcessor"}
    assert vae_processors == {AttnProcessor}
    apply_recipe(pipe, DiffusionSettings(attention="sdpa"))
    processors = pipe.transformer.attn_processors.values()
    if arch == "flux":
        assert {p._attention_backend.value for p in processors} == {"native"}
    else:
        assert {type(p) for p in processors} == {JointAttnProcessor2_0}
    assert {type(p) for p in pipe.vae.attn_processors.values()} == {AttnProcessor2_0}


@pytest.mark.parametrize("step", EAGER_STEPS)
def test_each_step_within_its_budget(arch, baseline, step):
    """The ladder's steps cumulatively (bf16 from the second on), against the fp32 baseline."""
    pipe = apply_recipe(tiny_pipeline(arch), eager(step))
    assert psnr(generate(pipe), baseline) >= STEP_PSNR
    transformer, vae = pipe.transformer, pipe.vae
    did = {
        "fused-qkv": lambda: any(k.endswith("to_added_qkv.weight") for k in transformer.state_dict()),
        "fused-attention": lambda: all(
            isinstance(p, FluxAttention) or getattr(p, "kernel", False) for p in transformer.attn_processors.values()
        ),
        "channels-last": lambda: vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last),
        "conv1x1-linear": lambda: any(isinstance(m, Conv1x1AsLinear) for m in vae.modules()),
        "dynamic-int8": lambda: any(isinstance(m, QuantLinear) for m in transformer.modules()),
        "int8-conv": lambda: any(isinstance(m, DynamicInt8Conv2d) for m in vae.decoder.modules()),
        "group-norm-kernel": lambda: any(isinstance(m, ChannelsLastGroupNorm) for m in vae.modules()),
    }
    assert did.get(step, lambda: True)(), f"{step} changed nothing"


def test_dynamic_fp8_within_its_budget(arch, baseline):
    """The dynamic-fp8 step's transform (the step itself asks for a GPU with fp8 tensor cores; on
    a CPU torch's `_scaled_mm` computes the same products without fp8 arithmetic), in place of
    dynamic-int8, every linear quantized: within its budget against the fp32 baseline."""
    settings = eager("dynamic-int8", dynamic_int8=False)
    pipe = apply_recipe(tiny_pipeline(arch), settings)
    _quantize_dynamic_fp8(pipe.transformer, replace(settings, dynamic_fp8=True))
    layers = [m for m in pipe.transformer.modules() if isinstance(m, Fp8DynamicLinear)]
    assert layers and not any(isinstance(m, QuantLinear) for m in pipe.transformer.modules())
    assert psnr(generate(pipe), baseline) >= FP8_PSNR


@pytest.mark.parametrize("step", FP32_EXACT_STEPS)
def test_fp32_rewrites_are_exact(arch, baseline, step):
    pipe = apply_recipe(tiny_pipeline(arch), eager(step, dtype="float32", dynamic_int8=False, int8_conv=False))
    assert (generate(pipe) - baseline).abs().max().item() <= FP32_EXACT


def test_fuse_unfuse_round_trip(arch):
    """diffusers' fused projections (both streams of joint attention); SD3 gets genfast's fused
    processor, which keeps SD 3.5's q/k norms and its dual-attention layer's image-only attention;
    unfusing restores the state dict and processors exactly."""
    transformer = apply_recipe(tiny_pipeline(arch), DiffusionSettings(attention="sdpa")).transformer
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    processors = {k: type(v) for k, v in transformer.attn_processors.items()}
    fuse_qkv(transformer)
    keys = transformer.state_dict().keys()
    assert any(k.endswith("to_qkv.weight") for k in keys) and any(k.endswith("to_added_qkv.weight") for k in keys)
    if arch == "sd3":
        assert all(isinstance(p, JointAttention) for p in transformer.attn_processors.values())
    unfuse_qkv(transformer)
    after = transformer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert {k: type(v) for k, v in transformer.attn_processors.items()} == processors


def test_convolution_steps_say_they_change_the_vae_only(arch):
    pipe = tiny_pipeline(arch)
    plan = RECIPE.plan("group-norm-kernel", pipeline_target(pipe, "bfloat16"))
    convolution_notes = {step: note for step, note in plan.notes if step not in ("bf16", "fused-attention")}
    assert {"channels-last", "conv1x1-linear"} <= convolution_notes.keys()
    assert all("changes the VAE only" in note for note in convolution_notes.values())
    unet = RECIPE.plan("group-norm-kernel", pipeline_target(tiny_pipeline("sd15"), "bfloat16"))
    assert [step for step, _ in unet.notes if step != "bf16"] == ["fused-attention"]  # (test_attention_kernel.py)


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_bf16_linears_multiply_in_fp32_where_bf16_products_are_slower(arch, baseline, monkeypatch, fast_bf16):
    """Where the CPU's bf16 products are slower than its fp32 ones (`hardware.fast_bf16_products`:
    an Intel Xeon without AMX) the bf16 step keeps bf16 tensors and every floating-point linear of
    the pipeline multiplies in fp32, fused projections included, and its row says so; dynamic int8
    still quantizes the denoiser's. Elsewhere they stay nn.Linear. (The convolutions of these tiny
    VAEs are narrower than FP32_CONV_MIN_CHANNELS: test_nn.py and quant/test_conv.py test theirs.)"""
    monkeypatch.setattr(hardware, "fast_bf16_products", lambda: fast_bf16)
    pipe = apply_recipe(tiny_pipeline(arch), eager("fused-qkv"))
    parts = [pipe.transformer, pipe.vae, pipe.text_encoder]
    wide = [name for part in parts for name, m in part.named_modules() if isinstance(m, Fp32ProductsLinear)]
    plain = [name for part in parts for name, m in part.named_modules() if type(m) is nn.Linear]
    note = dict(RECIPE.plan("fused-qkv", pipeline_target(pipe, "bfloat16")).notes).get("bf16")
    if fast_bf16:
        assert not wide and plain and note is None
    else:
        assert wide and not plain and "multiply in fp32" in note
        assert any(name.endswith("to_qkv") for name in wide)
        assert next(pipe.transformer.parameters()).dtype == torch.bfloat16
    assert psnr(generate(pipe), baseline) >= STEP_PSNR
    quantized = apply_recipe(tiny_pipeline(arch), eager("dynamic-int8")).transformer
    assert not any(isinstance(m, (Fp32ProductsLinear, nn.Linear)) for m in quantized.transformer_blocks.modules())


IMAGE_TO_IMAGE = {"flux": "FluxImg2ImgPipeline", "sd3": "StableDiffusion3Img2ImgPipeline"}


def test_other_pipelines_on_the_same_transformers(arch):
    """The recipe applies to any diffusers pipeline whose denoiser is one of these transformers:
    image-to-image on the tiny components. genfast's baseline is diffusers' own pipeline, the
    steps up to dynamic-int8 stay within their budget, and the block cache at threshold 0 changes
    nothing."""
    import diffusers

    from genfast.diffusion.block_cache import BlockCache

    def pipeline():
        return getattr(diffusers, IMAGE_TO_IMAGE[arch])(**tiny_pipeline(arch).components)

    start = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def transform(pipe):
        return pipe(
            "a red cat",
            image=start,
            strength=0.7,
            num_inference_steps=4,
            generator=torch.Generator().manual_seed(0),
            max_sequence_length=TEXT_TOKENS,
            output_type="pt",
        ).images.float()

    reference = transform(pipeline())
    assert (transform(apply_recipe(pipeline(), DiffusionSettings())) - reference).abs().max().item() <= REFERENCE_EXACT
    assert psnr(transform(apply_recipe(pipeline(), eager("dynamic-int8"))), reference) >= STEP_PSNR
    cached = apply_recipe(pipeline(), DiffusionSettings(feature_cache=True, block_cache_threshold=0.0))
    assert isinstance(cached.transformer, BlockCache)
    assert (transform(cached) - reference).abs().max().item() <= REFERENCE_EXACT


def test_sizes_and_latents(arch):
    """Flux: latents packed as FluxPipeline packs them (2x2 patches of latents, flattened), sizes
    in whole patches of latents, the default size the pipeline's own; SD3: its patch size."""
    pipe = tiny_pipeline(arch)
    latents = initial_latents(pipe, 48, 32, seed=1)
    if arch == "flux":
        assert latents.shape == (1, (24 // 2) * (16 // 2), 4 * 4) and native_size(pipe) == (256, 256)
        image = torch.randn(1, 4, 24, 16, generator=torch.Generator().manual_seed(1))
        assert torch.equal(latents, pipe._pack_latents(image, 1, 4, 24, 16))
    else:
        assert latents.shape == (1, 4, 24, 16) and native_size(pipe) == (32, 32)
    pipe.transformer = DenoiserWrapper(pipe.transformer)  # as tests and caches wrap it: still packed
    assert torch.equal(initial_latents(pipe, 48, 32, seed=1), latents)
    assert size_multiple(pipe) == 4
    with pytest.raises(UserError, match="multiples of 4"):
        check_size(pipe, 34, 32)
    check_size(pipe, 36, 32)


def test_dynamic_int8_threshold_keeps_the_dit_edges():
    """At the default threshold the tiny models (32 wide) keep every linear; at 32 the blocks'
    linears are quantized while the patch embedding (16 in) and output projection (16 out) stay,
    as the 64-value patches of the real FLUX.1 and SD 3.5 stay at 320."""
    pipe = apply_recipe(
        tiny_pipeline("flux"), eager("dynamic-int8", int8_min_features=DiffusionSettings().int8_min_features)
    )
    assert not any(isinstance(m, QuantLinear) for m in pipe.transformer.modules())
    transformer = apply_recipe(tiny_pipeline("flux"), eager("dynamic-int8", int8_min_features=32)).transformer
    assert isinstance(transformer.transformer_blocks[0].attn.to_out[0], QuantLinear)
    assert not isinstance(transformer.x_embedder, QuantLinear) and not isinstance(transformer.proj_out, QuantLinear)


@pytest.mark.slow
def test_full_compile_matches_eager(arch):
    """The whole transformer and the VAE decoder compiled (fullgraph: a graph break raises), no
    recompile on a second call."""
    recipe = replace(RECIPE.plan("compile", CPU_BF16).settings, dtype="float32")
    eager_pipe = apply_recipe(tiny_pipeline(arch), replace(recipe, compile="none"))
    pipe = apply_recipe(tiny_pipeline(arch), recipe)
    graphs = counters["stats"]["unique_graphs"]
    image = generate(pipe, steps=2)
    # The transformer's graph, and the VAE decoder's unless an earlier test of this process compiled
    # it (the tiny Flux and SD3 share one VAE structure: genfast/compilation/saved.py shares its code).
    first = counters["stats"]["unique_graphs"] - graphs
    assert first in (1, 2)
    assert torch.equal(generate(pipe, steps=2), image)
    assert counters["stats"]["unique_graphs"] - graphs == first
    assert (image - generate(eager_pipe, steps=2)).abs().max().item() <= 1e-3  # the compile budget in fp32


@pytest.mark.slow
def test_regional_dynamic_shapes_reuse_graphs_at_new_sizes(arch):
    """The dynamic-shapes recipe (bf16; each repeated block and the VAE decoder compiled with
    symbolic sizes): a second and third size (one not square) add no graph, and match eager."""
    recipe = replace(RECIPE.plan("dynamic-shapes", CPU_BF16).settings, dynamic_int8=False)
    eager_pipe = apply_recipe(tiny_pipeline(arch), replace(recipe, compile="none", dynamic_shapes=False))
    pipe = apply_recipe(tiny_pipeline(arch), recipe)
    generate(pipe, steps=2)
    graphs = counters["stats"]["unique_graphs"]
    for size in ((48, 32), (24, 24)):
        image = generate(pipe, size, steps=2)
        assert counters["stats"]["unique_graphs"] == graphs, f"recompiled at {size}"
        assert psnr(image, generate(eager_pipe, size, steps=2)) >= COMPILED_BF16_PSNR


def test_imagine_on_a_saved_flux_pipeline(tmp_path, capsys):
    """`genfast imagine --model DIR` on a saved tiny FLUX.1-dev-shaped pipeline: the pipeline's own
    guidance (3.5) by default, the image diffusers' own for the seed; bad requests are one line."""
    pipe = tiny_pipeline("flux")
    pipe.save_pretrained(tmp_path / "flux")
    out = tmp_path / "out.png"
    common = ["--model", str(tmp_path / "flux"), "--size", "48x32", "--denoising-steps", "2", "--seed", "5"]
    assert cli.main(["imagine", "a red square", *common, "--recipe", "baseline", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "48x32, 2 steps, guidance 3.5" in err and "RANDOM" not in err
    apply_recipe(pipe, DiffusionSettings())
    expected = pipe(
        "a red square", height=32, width=48, num_inference_steps=2, generator=torch.Generator().manual_seed(5)
    ).images[0]
    with Image.open(out) as img:
        assert img.size == (48, 32) and img.text["genfast:guidance"] == "3.5"
        assert np.array_equal(np.asarray(img), np.asarray(expected))
    for argv, message in ((["--negative", "blurry"], "takes no --negative prompt"),):
        assert cli.main(["imagine", "x", *common, *argv, "-o", str(tmp_path / "bad.png")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and not (tmp_path / "bad.png").exists()
