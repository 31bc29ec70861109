"""diffusion-fast's recipe (and diffusers' later guide) as named steps, each on top of the previous.

| step | what changes | budget vs the fp32 baseline image (tiny random pipelines, tests/diffusion) |
|---|---|---|
| baseline | fp32, attention by explicit softmax (`AttnProcessor`), eager | the reference |
| bf16 | weights and activations in bfloat16 (text encoders included) | PSNR >= 35 dB (tiny models: ~48) |
| sdpa | `AttnProcessor2_0`: `F.scaled_dot_product_attention` | in fp32 ~exact: max abs diff <= 1e-4; cumulative: as bf16 |
| channels_last | denoiser and VAE weights/activations in NHWC | fp32 max abs diff <= 1e-4; cumulative: as bf16 |
| fused-qkv | one QKV (self-) / KV (cross-attention) linear, diffusers' fuse_qkv_projections | fp32 max abs diff <= 1e-4; cumulative: as bf16 |
| conv1x1-linear | every 1x1 Conv2d of denoiser and VAE runs as a Linear over channels | fp32 max abs diff <= 1e-4; cumulative: as bf16 |
| compile | torch.compile (fullgraph) of the denoiser and the VAE decoder | as bf16 (fp32: max abs diff <= 1e-3) |
| dynamic-int8 | int8 activations x int8 weights in the linears `int8_keep` leaves (shape rule) | PSNR >= 35 dB (tiny models, every linear quantized: 45-53) |
| int8-conv | uint8 activations x int8 weights in the denoiser's and VAE decoder's convolutions `int8_conv_keep` leaves (CPU with oneDNN; skipped with a warning elsewhere) | PSNR >= 35 dB (tiny models, every conv quantized) |
| group-norm-kernel | GroupNorm of channels-last activations by genfast's native CPU kernel (`group_norm.py`; a no-op, with a warning, without AVX-512 or AVX2 or off the CPU) | fp32 max abs diff <= 1e-4; cumulative: as int8-conv |
| regional-compile | instead of whole-model compile: each repeated (transformer) block compiled | as dynamic-int8 |
| dynamic-shapes | the compiled regions and VAE decoder take symbolic sizes: a new resolution does not recompile | as dynamic-int8 |
| feature-cache | DeepCache: UNet deep features reused every other step (`feature_cache_interval=2`) | not accuracy-preserving: PSNR >= 30 dB vs the same recipe uncached on tiny models (measured ~50) |

On a CPU without native bf16 arithmetic (no AVX512-BF16 or AMX: bf16 is emulated and slower than
fp32) `--dtype auto` leaves the bf16 step out and every later step computes in fp32.

"Scheduler state on the host, no device syncs in the loop" is not a step: diffusers' pipelines
and schedulers keep step indices as Python ints and sigmas on the CPU, and nothing genfast puts
in the denoiser reads a tensor's value on the host (tests/diffusion/test_syncs.py counts such
reads, `aten::_local_scalar_dense`, inside the denoiser: zero for SD 1.5, SDXL and PixArt with
every eager step; a fullgraph-compiled denoiser cannot contain one). Per image, the Euler
scheduler reads one device value (the first step's index). Not yet run on CUDA
(`torch.cuda.set_sync_debug_mode`): no GPU was available.

dynamic-shapes compiles with symbolic sizes (`dynamic=True`, each size its own symbol: no
"duck sizing", which tied height to width after a square first image and recompiled at the first
non-square one), so a new resolution reuses the graphs: tested on tiny SD 1.5 and PixArt
pipelines over 128x128 -> 160x96 -> 96x96 (bf16, CPU, torch 2.13); `genfast bench diffusion`
reports the graphs a second size adds at the real size. In fp32 one recompile remains possible
on the CPU: ATen runs batch-1 convolutions under 20480 input elements with its native kernel
instead of oneDNN, a size guard (bf16 always takes oneDNN).

`apply_recipe` works on any diffusers pipeline with a `unet` or `transformer` and a `vae`;
a step that does not apply to it raises ValueError saying why.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from genfast.diffusion import DIFFUSION_STEPS
from genfast.diffusion.attention import fuse_qkv, set_attention
from genfast.diffusion.compiling import compile_module, compile_regions, compile_vae_decoder
from genfast.diffusion.conv1x1 import conv1x1_to_linear
from genfast.diffusion.feature_cache import DeepCacheUNet
from genfast.diffusion.group_norm import unavailable_reason as group_norm_unavailable_reason
from genfast.diffusion.group_norm import use_channels_last_group_norm
from genfast.diffusion.pipelines import denoiser_name, denoiser_of
from genfast.quant.conv import ConvFilter, int8_conv_unavailable_reason, quantize_dynamic_int8_convs
from genfast.quant.linear import LinearFilter, quantize_dynamic_int8

COMPILE_MODES = ("none", "full", "regional")
# Linears with fewer input or output features gain little from int8 (the rescaling dominates) and
# are where its error matters most. 320 is the narrowest width of SD 1.5/SDXL's UNets, so at the real
# sizes this quantizes the attention and feed-forward linears and leaves the time/text embeddings.
INT8_MIN_FEATURES = 320
# Convolutions with fewer channels in or out stay in floating point: the first and last layers of
# the UNet and VAE (3 or 4 image/latent channels), which gain nothing and carry the most error.
# Every other convolution of SD 1.5/SDXL has >= 128 (measured on the SD 1.5 VAE decoder at 512 x 512:
# thresholds 512 / 256 / 128 took its decode from 3.74 s to 3.31 / 3.01 / 2.74 s:
# `python benchmarks/diffusion_parts.py vae`, docs/performance.md).
INT8_CONV_MIN_CHANNELS = 128


@dataclass(frozen=True)
class DiffusionRecipe:
    dtype: torch.dtype = torch.float32
    attention: str = "math"
    channels_last: bool = False
    fuse_qkv: bool = False
    conv1x1_linear: bool = False
    compile: str = "none"  # "none" | "full" (denoiser + VAE decoder) | "regional" (repeated blocks + VAE decoder)
    dynamic_int8: bool = False
    int8_min_features: int = INT8_MIN_FEATURES
    int8_conv: bool = False
    int8_conv_min_channels: int = INT8_CONV_MIN_CHANNELS
    group_norm_kernel: bool = False
    dynamic_shapes: bool = False  # compile with symbolic sizes: a new resolution reuses the graphs
    feature_cache_interval: int = 0  # 0: off; N: full UNet every N steps


def recipe_for_step(step: str, low_precision: torch.dtype | None = torch.bfloat16) -> DiffusionRecipe:
    """The recipe with every step up to and including `step`. `low_precision` is the dtype the
    "bf16" step switches to; None leaves that step out, so every later step computes in fp32 (what
    a CPU without native bf16 arithmetic should do: genfast.hardware.low_precision_dtype)."""
    if step not in DIFFUSION_STEPS:
        raise ValueError(f"unknown diffusion step {step!r}; choose one of {', '.join(DIFFUSION_STEPS)}")
    changes: dict[str, dict[str, Any]] = {
        "bf16": {"dtype": low_precision} if low_precision is not None else {},
        "sdpa": {"attention": "sdpa"},
        "channels_last": {"channels_last": True},
        "fused-qkv": {"fuse_qkv": True},
        "conv1x1-linear": {"conv1x1_linear": True},
        "compile": {"compile": "full"},
        "dynamic-int8": {"dynamic_int8": True},
        "int8-conv": {"int8_conv": True},
        "group-norm-kernel": {"group_norm_kernel": True},
        "regional-compile": {"compile": "regional"},
        "dynamic-shapes": {"dynamic_shapes": True},
        "feature-cache": {"feature_cache_interval": 2},
    }
    recipe = DiffusionRecipe()
    for name in DIFFUSION_STEPS[: DIFFUSION_STEPS.index(step) + 1]:
        recipe = replace(recipe, **changes.get(name, {}))
    return recipe


def int8_keep(min_features: int = INT8_MIN_FEATURES) -> LinearFilter:
    """The dynamic-int8 filter, a function of the layer's shape only: a linear stays in floating
    point when min(in_features, out_features) < `min_features` (see INT8_MIN_FEATURES)."""
    def keep(name: str, linear: nn.Linear) -> bool:
        return min(linear.in_features, linear.out_features) < min_features

    return keep


def int8_conv_keep(min_channels: int = INT8_CONV_MIN_CHANNELS) -> ConvFilter:
    """The int8-conv filter, a function of the layer's shape only: a convolution stays in floating
    point when min(in_channels, out_channels) < `min_channels` (see INT8_CONV_MIN_CHANNELS)."""
    def keep(name: str, conv: nn.Conv2d) -> bool:
        return min(conv.in_channels, conv.out_channels) < min_channels

    return keep


def validate(recipe: DiffusionRecipe) -> None:
    """Reject combinations that cannot run, before anything is changed."""
    if recipe.compile not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {recipe.compile!r}; choose one of {', '.join(COMPILE_MODES)}")
    if recipe.feature_cache_interval and recipe.compile == "full":
        raise ValueError("the feature cache runs the UNet's blocks one by one: use regional compilation, "
                         "not whole-denoiser compile")
    if recipe.dynamic_shapes and recipe.compile == "none":
        raise ValueError("dynamic_shapes is a compile option: it needs compile 'full' or 'regional'")
    if recipe.feature_cache_interval < 0:
        raise ValueError(f"feature_cache_interval must be >= 0, got {recipe.feature_cache_interval}")


def apply_recipe(pipe: Any, recipe: DiffusionRecipe) -> Any:
    """Apply `recipe` to a freshly loaded diffusers pipeline in place (and return it). The order
    matters: processors before fusing, shape changes (fusing, conv->linear, int8) before compiling,
    the feature cache around the (regionally compiled) UNet last."""
    validate(recipe)
    denoiser = denoiser_of(pipe)
    vae = getattr(pipe, "vae", None)
    if vae is None:
        raise ValueError(f"{type(pipe).__name__} has no `vae`: genfast's steps do not apply")
    models = [denoiser, vae]
    if recipe.feature_cache_interval and type(denoiser).__name__ != "UNet2DConditionModel":
        raise ValueError(f"feature caching is implemented for UNet2DConditionModel, not {type(denoiser).__name__}")
    if next(denoiser.parameters()).dtype != recipe.dtype:  # (diffusers warns on every cast)
        pipe.to(dtype=recipe.dtype)
    for model in models:
        set_attention(model, recipe.attention)
    if recipe.channels_last:
        for model in models:
            model.to(memory_format=torch.channels_last)
    if recipe.fuse_qkv:
        if recipe.attention != "sdpa":
            raise ValueError("fused QKV uses diffusers' FusedAttnProcessor2_0 (SDPA): it needs attention 'sdpa'")
        for model in models:
            fuse_qkv(model)
    if recipe.conv1x1_linear:
        for model in models:
            conv1x1_to_linear(model)
    if recipe.dynamic_int8:
        quantize_dynamic_int8(denoiser, keep=int8_keep(recipe.int8_min_features))
    # The two CPU kernels below are skipped, with a warning, where they cannot run, so that one
    # recipe serves every device.
    if recipe.int8_conv:
        reason = int8_conv_unavailable_reason(next(denoiser.parameters()).device)
        if reason:
            warnings.warn(f"int8-conv skipped: {reason}", stacklevel=2)
        else:
            for model in (denoiser, getattr(vae, "decoder", vae)):  # (txt2img runs no VAE encoder)
                quantize_dynamic_int8_convs(model, keep=int8_conv_keep(recipe.int8_conv_min_channels))
    if recipe.group_norm_kernel:
        if not sum(use_channels_last_group_norm(model) for model in models):
            warnings.warn(f"group-norm-kernel has no effect here: {group_norm_unavailable_reason() or 'not on the CPU'}",
                          stacklevel=2)
    if recipe.compile == "full":
        compile_module(denoiser, dynamic=recipe.dynamic_shapes)
    elif recipe.compile == "regional":
        compile_regions(denoiser, dynamic=recipe.dynamic_shapes)
    if recipe.compile != "none":
        compile_vae_decoder(vae, dynamic=recipe.dynamic_shapes)
    if recipe.feature_cache_interval:
        setattr(pipe, denoiser_name(pipe), DeepCacheUNet(denoiser, pipe.scheduler, recipe.feature_cache_interval))
    return pipe
