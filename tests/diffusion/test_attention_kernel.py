"""The fused-attention step: FLUX.1's and SD3's attention on genfast's native kernel, against
diffusers' own processors (SDPA) on tiny random transformers, with the kernel's calls counted so
that a silent fallback to SDPA cannot pass."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("diffusers")

from genfast.diffusion.attention import FluxAttention, JointAttention, fuse_qkv, use_attention_kernel
from genfast.diffusion.pipelines import tiny_pipeline
from genfast.diffusion.recipe import RECIPE, DiffusionSettings, apply_recipe, pipeline_target
from genfast.errors import UserError
from genfast.kernels.rel_pos_attention import ops as kernel
from genfast.platform import hardware

# bf16 outputs of a whole tiny transformer, the kernel against SDPA (both accumulate in fp32; they
# differ in the order of the sums and where probabilities are rounded to bf16): max abs difference
# over the output's scale (measured ~0.4%).
BF16_RELATIVE = 0.02
FP32_EXACT = 1e-5  # fp32 on AVX-512: the kernel takes no fp32, so the processors run SDPA as diffusers does
FP32_RELATIVE = 1e-4  # fp32 on AVX2, whose kernel computes in fp32: max abs difference over the scale (measured ~3e-7)
# 32 x 32 image tokens (2x2 patches for SD3) and 8 text tokens: 1032 keys, long enough for the AVX2
# variant, which runs only on 1024-4096 keys (ops.attention_pays), still tiny models.
GRID, TEXT_TOKENS = 32, 8
needs_kernel = pytest.mark.skipif(
    not kernel.takes(torch.bfloat16),
    reason=f"the native attention kernel does not run here: {kernel.unavailable_reason()}",
)


def kernel_calls(fn) -> tuple[torch.Tensor, int]:
    """fn()'s output and how many times it called the native attention kernel."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = fn()
    return out, sum(event.count for event in profile.key_averages() if event.key == "genfast::attention")


# Head dimension 32: the smallest that every variant computes itself (the AMX variant's tiles
# take multiples of 32; the tiny pipelines' 8 and 16 run SDPA there).
HEAD_DIM = 32


def tiny_flux(dtype: torch.dtype):
    """The tiny pipeline's FLUX.1 transformer (genfast.diffusion.pipelines) with heads of HEAD_DIM."""
    from diffusers import FluxTransformer2DModel

    config = {**tiny_pipeline("flux").transformer.config, "attention_head_dim": HEAD_DIM, "axes_dims_rope": (8, 8, 16)}
    torch.manual_seed(0)
    return FluxTransformer2DModel.from_config(config).eval().to(dtype)


def tiny_sd3(dtype: torch.dtype):
    """SD 3.5-medium's layout (RMS-normed q/k, a dual-attention layer) with heads of HEAD_DIM."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return (
        SD3Transformer2DModel(
            sample_size=GRID,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=2,
            joint_attention_dim=32,
            caption_projection_dim=2 * HEAD_DIM,  # the inner width: heads x head dim
            pooled_projection_dim=32,
            out_channels=4,
            pos_embed_max_size=GRID,
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
        )
        .eval()
        .to(dtype)
    )


def flux_inputs(model, dtype: torch.dtype) -> dict:
    generator = torch.Generator().manual_seed(1)
    tokens, text = GRID * GRID, TEXT_TOKENS
    config = model.config

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    axis = torch.arange(float(GRID))
    ids = torch.stack(torch.meshgrid(torch.zeros(1), axis, axis, indexing="ij"), -1)
    return {
        "hidden_states": randn(1, tokens, config.in_channels),
        "encoder_hidden_states": randn(1, text, config.joint_attention_dim),
        "pooled_projections": randn(1, config.pooled_projection_dim),
        "timestep": torch.tensor([0.5], dtype=dtype),
        "guidance": torch.tensor([3.5], dtype=dtype),
        "img_ids": ids.reshape(-1, 3),
        "txt_ids": torch.zeros(text, 3),
        "return_dict": False,
    }


def sd3_inputs(model, dtype: torch.dtype) -> dict:
    generator = torch.Generator().manual_seed(1)
    config = model.config
    return {
        "hidden_states": torch.randn(2, config.in_channels, 2 * GRID, 2 * GRID, generator=generator).to(dtype),
        "encoder_hidden_states": torch.randn(2, TEXT_TOKENS, config.joint_attention_dim, generator=generator).to(dtype),
        "pooled_projections": torch.randn(2, config.pooled_projection_dim, generator=generator).to(dtype),
        "timestep": torch.tensor([500.0, 500.0]),
        "return_dict": False,
    }


MODELS = {"flux": (tiny_flux, flux_inputs, FluxAttention, 4), "sd3": (tiny_sd3, sd3_inputs, JointAttention, 3)}


@pytest.fixture(params=sorted(MODELS))
def arch(request):
    return request.param


@needs_kernel
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-qkv"])
def test_kernel_attention_matches_diffusers(arch, fused, monkeypatch):
    """Every attention module (Flux: 2 double- and 2 single-stream; SD3: 2 joint and the
    dual-attention layer's image-only one) calls the kernel once, and the transformer's output
    stays within bf16's difference of diffusers' SDPA processors."""
    build, inputs, processor, modules = MODELS[arch]
    # The kernel's results: on a CPU with AMX, SDPA computes attentions this long (ops.attention_pays).
    monkeypatch.setattr(hardware, "has_amx_bf16", lambda: False)
    model = build(torch.bfloat16)
    args = inputs(model, torch.bfloat16)
    with torch.inference_mode():
        reference = model(**args)[0].float()
        if fused:
            fuse_qkv(model)
        assert use_attention_kernel(model) == modules
        assert all(isinstance(p, processor) for p in model.attn_processors.values())
        out, calls = kernel_calls(lambda: model(**args)[0].float())
    assert calls == modules
    assert (out - reference).abs().max().item() <= BF16_RELATIVE * reference.abs().max().item()
    assert not torch.equal(out, reference)  # the kernel ran, not SDPA again


def test_fp32_runs_sdpa_exactly_where_the_kernel_takes_none(arch):
    """Where the loaded kernel takes no fp32 (AVX-512), the processors fall back to SDPA and match
    diffusers' own exactly; where it does (AVX2), it runs in fp32, within fp32's difference."""
    build, inputs, _, modules = MODELS[arch]
    model = build(torch.float32)
    args = inputs(model, torch.float32)
    with torch.inference_mode():
        reference = model(**args)[0]
        assert use_attention_kernel(model) == modules
        out, calls = kernel_calls(lambda: model(**args)[0])
    if kernel.takes(torch.float32):
        assert calls == modules
        assert (out - reference).abs().max().item() <= FP32_RELATIVE * reference.abs().max().item()
    else:
        assert calls == 0
        assert (out - reference).abs().max().item() <= FP32_EXACT


def test_models_without_flux_or_sd3_attention_are_left_alone():
    pipe = tiny_pipeline("sd15")
    processors = {name: type(p) for name, p in pipe.unet.attn_processors.items()}
    assert use_attention_kernel(pipe.unet) == 0
    assert {name: type(p) for name, p in pipe.unet.attn_processors.items()} == processors


def test_other_processors_are_refused():
    model = tiny_flux(torch.float32)
    for module in model.modules():
        if hasattr(module, "set_attention_backend"):
            module.set_attention_backend("_native_math")
    with pytest.raises(ValueError, match="_native_math"):
        use_attention_kernel(model)


def test_recipe_step_notes_and_validation(monkeypatch):
    """The step says where it runs SDPA instead (UNets; fp32 where the kernel takes none; in part
    on a CPU with AMX) and needs SDPA attention to replace."""
    unet = RECIPE.plan("fused-attention", pipeline_target(tiny_pipeline("sd15"), "bfloat16"))
    assert dict(unet.notes)["fused-attention"].startswith("changes FLUX.1's and SD3's attention only")
    if kernel.takes(torch.bfloat16):
        for amx in (False, True):
            monkeypatch.setattr(hardware, "has_amx_bf16", lambda amx=amx: amx)
            flux = RECIPE.plan("fused-attention", pipeline_target(tiny_pipeline("flux"), "bfloat16"))
            note = dict(flux.notes).get("fused-attention")
            assert note is None if not amx or kernel.loaded_isa() != "avx512" else note.startswith("AMX: ")
    if not kernel.takes(torch.float32):
        fp32 = RECIPE.plan("fused-attention", pipeline_target(tiny_pipeline("flux"), "float32"))
        assert "SDPA" in dict(fp32.notes)["fused-attention"]
    with pytest.raises(UserError, match="needs attention 'sdpa'"):
        apply_recipe(tiny_pipeline("flux"), DiffusionSettings(attention_kernel=True))


@needs_kernel
def test_the_ladder_step_switches_the_pipeline_to_the_kernel():
    """The recipe's fused-attention step on a whole tiny FLUX.1 pipeline (bf16): its transformer's
    modules run the kernel; the steps before it leave diffusers' processors."""
    settings = replace(RECIPE.settings("fused-attention"), compile="none")
    pipe = apply_recipe(tiny_pipeline("flux"), settings)
    assert {type(p) for p in pipe.transformer.attn_processors.values()} == {FluxAttention}
    before = apply_recipe(tiny_pipeline("flux"), replace(RECIPE.settings("fused-qkv"), compile="none"))
    assert not any(isinstance(p, FluxAttention) for p in before.transformer.attn_processors.values())
