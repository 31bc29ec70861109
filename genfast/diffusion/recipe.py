"""diffusion-fast's recipe (and diffusers' later guide) as named steps, each on top of the previous.

The steps, in ladder order, with what each changes and its accuracy budget against the fp32
baseline image (tiny random pipelines, tests/diffusion), are the `RECIPE` below; `genfast bench
diffusion --list-steps` prints them as a table with how each runs on this machine. bf16 covers
the text encoders too; the feature cache reuses a UNet's deep features every other step and
skips a transformer's blocks after the first on steps where the first changed little.

On a CPU without native bf16 arithmetic (no AVX512-BF16 or AMX: bf16 is emulated and slower than
fp32) `--dtype auto` leaves the bf16 step out and every later step computes in fp32. On one whose
bf16 products are slower than its fp32 ones (an Intel Xeon without AMX:
`hardware.fast_bf16_products`), and wherever bf16 is asked for on the former, the tensors stay bf16
and the floating-point linears and convolutions multiply in fp32 (`genfast.nn.use_fp32_products`):
bf16's memory at fp32's rate where the time is in products.

"Scheduler state on the host, no device syncs in the loop" is not a step: diffusers' pipelines
and schedulers keep step indices as Python ints and sigmas on the CPU, and nothing genfast puts
in the denoiser reads a tensor's value on the host (tests/diffusion/test_syncs.py counts such
reads, `aten::_local_scalar_dense`, inside the denoiser: zero for SD 1.5, SDXL and PixArt with
every eager step; a fullgraph-compiled denoiser cannot contain one), but for the block cache of
transformers: one per step past its warm-up (genfast/diffusion/block_cache.py says why). Per image, the Euler
scheduler reads one device value (the first step's index). On CUDA, tests/cuda counts syncs with
`torch.cuda.set_sync_debug_mode` inside the denoiser's calls: none in PixArt's regionally compiled
dynamic-int8 loop on an H200 (torch 2.11); SD 1.5's and SDXL's checks have not run on a GPU yet.

dynamic-shapes compiles with symbolic sizes (`dynamic=True`, each size its own symbol: no
"duck sizing", which tied height to width after a square first image and recompiled at the first
non-square one), so a new resolution reuses the graphs: tested on tiny SD 1.5 and PixArt
pipelines over 128x128 -> 160x96 -> 96x96 (bf16, CPU, torch 2.13); `genfast bench diffusion`
reports the graphs a second size adds at the real size. In fp32 one recompile remains possible
on the CPU: ATen runs batch-1 convolutions under 20480 input elements with its native kernel
instead of oneDNN, a size guard (bf16 always takes oneDNN).

`apply_recipe` works on any diffusers pipeline with a `unet` or `transformer` and a `vae`:
SD 1.5, SDXL, SSD-1B (UNets), PixArt-α, Stable Diffusion 3/3.5 and FLUX.1 (transformers) are
tested on tiny random pipelines. A step that does not apply to it raises UserError saying why.
Steps that cannot run on this machine (int8-conv without oneDNN, group-norm-kernel without its
native kernel) or on this pipeline (feature-cache on a denoiser it does not know) follow the recipe's one rule
(genfast/recipe.py): left out of a longer recipe with the reason, refused by name. The pipeline is
part of the target (`pipeline_target`). On a transformer pipeline the convolution steps
(channels-last, conv1x1-linear, int8-conv, group-norm-kernel) change the VAE only, the
transformer's one convolution being its patch embedding (SD3) or none (Flux): they run, and the
plan says so in a note (`Step.fallback`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from genfast import steps
from genfast.errors import UserError
from genfast.recipe import Recipe, Stage, Step, Target, Transform, settings_key

COMPILE_MODES = ("none", "full", "regional")
# What `genfast imagine` runs unless told otherwise: no compile (minutes on a CPU), and an image that
# does not depend on the thread count, which genfast lowers beside busy work. The faster eager step on
# a CPU, fused-attention, brings channels-last, whose bf16 oneDNN convolutions round differently with
# the thread count (docs/diffusion.md).
DEFAULT_STEP = "sdpa"
# Linears with fewer input or output features gain little from int8 (the rescaling dominates) and
# are where its error matters most. 320 is the narrowest width of SD 1.5/SDXL's UNets, so at the real
# sizes this quantizes the attention and feed-forward linears and leaves the time/text embeddings.
# The DiTs are wider (SD 3.5 medium 1536, FLUX.1 3072): it quantizes all their blocks' linears and
# the text projections, and leaves the 256-wide sinusoidal time (and guidance) embedding's first
# linear and the patch embedding and output projection (64 latent values per patch).
INT8_MIN_FEATURES = 320
# Convolutions with fewer channels in or out stay in floating point: the first and last layers of
# the UNet and VAE (3 or 4 image/latent channels), which gain nothing and carry the most error.
# Every other convolution of SD 1.5/SDXL has >= 128 (measured on the SD 1.5 VAE decoder at 512 x 512:
# thresholds 512 / 256 / 128 took its decode from 3.74 s to 3.31 / 3.01 / 2.74 s:
# `python benchmarks/diffusion_parts.py vae`).
INT8_CONV_MIN_CHANNELS = 128
# The block cache's relative change of the first block's residual under which the other blocks are
# skipped: cache-dit's default (residual_diff_threshold) and ParaAttention's suggestion for FLUX.1.
BLOCK_CACHE_THRESHOLD = 0.08


@dataclass(frozen=True)
class DiffusionSettings(steps.StepSettings):
    """What the recipe's steps set; `apply_recipe` makes a pipeline so."""

    attention: str = "math"
    channels_last: bool = False
    fuse_qkv: bool = False
    attention_kernel: bool = False  # FLUX.1's and SD3's attention by genfast's native CPU kernel
    conv1x1_linear: bool = False
    compile: str = "none"  # "none" | "full" (denoiser + VAE decoder) | "regional" (repeated blocks + VAE decoder)
    # CUDA: diffusion-fast's compile-time tuning (compiling.diffusion_inductor_options); the GPU
    # tests turn it off where they check other properties of the compiled code.
    max_autotune: bool = True
    dynamic_int8: bool = False
    dynamic_fp8: bool = False  # fp8 activations x fp8 weights instead of int8 (GPUs with fp8 tensor cores)
    int8_min_features: int = INT8_MIN_FEATURES
    int8_conv: bool = False
    int8_conv_min_channels: int = INT8_CONV_MIN_CHANNELS
    group_norm_kernel: bool = False
    dynamic_shapes: bool = False  # compile with symbolic sizes: a new resolution reuses the graphs
    # The feature-cache step. A UNet runs whole every feature_cache_interval steps (DeepCache); a
    # transformer runs every block at least every feature_cache_interval steps, and on the steps
    # between skips its middle blocks when its first block_cache_front blocks' residual changed
    # less than block_cache_threshold since the last full step (the block cache), never in its
    # first block_cache_warmup steps; its last block_cache_back blocks run on every step.
    feature_cache: bool = False
    feature_cache_interval: int = 2
    block_cache_threshold: float = BLOCK_CACHE_THRESHOLD
    block_cache_warmup: int = 1
    block_cache_front: int = 1
    block_cache_back: int = 0


@dataclass(frozen=True)
class PipelineTarget(Target):
    """A Target that also knows the pipeline's denoiser class: the steps that depend on it (the
    feature cache needs a UNet or a known transformer; the convolution steps change only the VAE of a transformer
    pipeline) say so when a plan is made for it. Without it (before a pipeline is loaded) those
    steps are assumed to apply."""

    denoiser: str | None = None
    quantized: bool = False  # its linears were quantized as loaded (--quant int8)


UNET = "UNet2DConditionModel"


def pipeline_target(pipe: Any, dtype: str, quantized: bool = False) -> PipelineTarget:
    """Where `pipe` runs (its denoiser's device), with the user's --dtype and its denoiser class;
    `quantized`: loaded with --quant int8."""
    from genfast.diffusion.pipelines import DenoiserWrapper, denoiser_of

    denoiser = denoiser_of(pipe)
    while isinstance(denoiser, DenoiserWrapper):  # the class that decides is the wrapped one
        denoiser = denoiser.denoiser
    return PipelineTarget(next(denoiser.parameters()).device, dtype, type(denoiser).__name__, quantized)


def _denoiser(target: Target) -> str | None:
    return getattr(target, "denoiser", None)


def _feature_cache_unavailable(target: Target) -> str | None:
    from genfast.diffusion.block_cache import TRANSFORMERS

    denoiser = _denoiser(target)
    if denoiser is None or denoiser == UNET or denoiser in TRANSFORMERS:
        return None
    return (
        f"the feature cache reuses a {UNET}'s deep features (DeepCache) or the blocks of "
        f"{', '.join(TRANSFORMERS)} (the block cache); this pipeline's denoiser is {denoiser}: "
        "choose an earlier --recipe step for it"
    )


def _fused_qkv_declined(target: Target) -> str | None:
    if getattr(target, "quantized", False):
        return "the denoiser's linears were quantized as loaded (--quant int8): diffusers fuses float projections"
    return None


def _fp8_declined(target: Target) -> str | None:
    """dynamic-fp8 is the GPUs' alternative to dynamic-int8: where fp8 products are missing, the
    int8 step stays and a longer recipe leaves this one out without a word (asked for by name, it
    says why)."""
    if getattr(target, "quantized", False):
        return "the denoiser's linears were quantized to int8 as loaded (--quant int8)"
    from genfast.quant.fp8 import unavailable_reason

    return unavailable_reason(target.device)


def _attention_kernel_note(target: Target) -> str | None:
    """How the fused-attention step runs here when not as the native kernel on FLUX.1's or SD3's
    attention: SDPA on other denoisers, devices and dtypes."""
    from genfast.diffusion.attention import KERNEL_DENOISERS

    denoiser = _denoiser(target)
    if denoiser is not None and denoiser not in KERNEL_DENOISERS:
        return f"changes FLUX.1's and SD3's attention only ({denoiser}: SDPA)"
    if target.device.type != "cpu":
        return "the attention kernel is a CPU kernel: SDPA"
    return steps.attention_kernel_cpu_note(target)


def _vae_only_note(target: Target) -> str | None:
    """The convolution steps on a transformer pipeline: they run, on the VAE."""
    denoiser = _denoiser(target)
    if denoiser is None or denoiser == UNET:
        return None
    return f"changes the VAE only ({denoiser}: no convolution but at most a patch embedding)"


def _int8_conv_unavailable(target: Target) -> str | None:
    from genfast.quant.conv import int8_conv_unavailable_reason

    return int8_conv_unavailable_reason(target.device)


def _group_norm_kernel_unavailable(target: Target) -> str | None:
    if target.device.type != "cpu":
        return "the channels-last GroupNorm kernel is a CPU kernel"
    from genfast.kernels.group_norm.ops import unavailable_reason

    return unavailable_reason()


# The steps' transforms. The parts: "pipe" (the diffusers pipeline), "denoiser" (its UNet or
# transformer), "vae" and "vae_decoder" (the VAE's decoder: txt2img runs no VAE encoder).
MODELS = ("denoiser", "vae")


def _cast(pipe: Any, settings: DiffusionSettings) -> None:
    from genfast.diffusion.pipelines import denoiser_of
    from genfast.platform.hardware import DTYPES

    dtype = DTYPES[settings.dtype]
    if next(denoiser_of(pipe).parameters()).dtype != dtype:  # (diffusers warns on every cast)
        pipe.to(dtype=dtype)


def _slow_bf16_products(device: Any) -> bool:
    from genfast.platform import hardware

    return device.type == "cpu" and not hardware.fast_bf16_products()


def _fp32_products_note(target: Target) -> str | None:
    if target.dtype == "float32" or not _slow_bf16_products(target.device):
        return None
    return (
        "this CPU's bf16 products are slower than its fp32 ones: "
        "the floating-point linears and convolutions multiply in fp32"
    )


def _fp32_products(pipe: Any, settings: DiffusionSettings) -> None:
    """In bf16 on a CPU whose bf16 products are slower than its fp32 ones, every floating-point
    linear and convolution of the pipeline (denoiser, text encoders, VAE) multiplies in fp32: a
    transformer denoiser's time is nearly all in its linears, a VAE decoder's in its convolutions
    (docs/notes.md measures both). Runs after the rewrites, so that fused projections are among
    them; the int8 steps then replace the ones they quantize."""
    from torch import nn

    from genfast.diffusion.loading import TEXT_ENCODERS
    from genfast.diffusion.pipelines import denoiser_of
    from genfast.nn import use_fp32_products

    denoiser = denoiser_of(pipe)
    if settings.dtype != "bfloat16" or not _slow_bf16_products(next(denoiser.parameters()).device):
        return
    for name in (*TEXT_ENCODERS, "vae"):
        part = getattr(pipe, name, None)
        if isinstance(part, nn.Module):
            use_fp32_products(part)
    use_fp32_products(denoiser)


def _set_attention(model: Any, settings: DiffusionSettings) -> None:
    from genfast.diffusion.attention import set_attention

    set_attention(model, settings.attention)


def _channels_last(model: Any, settings: DiffusionSettings) -> None:
    import torch

    model.to(memory_format=torch.channels_last)


def _fuse_qkv(model: Any, settings: DiffusionSettings) -> None:
    from genfast.diffusion.attention import fuse_qkv

    fuse_qkv(model)


def _use_attention_kernel(model: Any, settings: DiffusionSettings) -> None:
    from genfast.diffusion.attention import use_attention_kernel

    use_attention_kernel(model)


def _conv1x1_to_linear(model: Any, settings: DiffusionSettings) -> None:
    from genfast.diffusion.conv1x1 import conv1x1_to_linear

    conv1x1_to_linear(model)


def _quantize_dynamic_int8(denoiser: Any, settings: DiffusionSettings) -> None:
    from genfast.quant.linear import narrower_than, quantize_dynamic_int8

    quantize_dynamic_int8(denoiser, keep=narrower_than(settings.int8_min_features))


def _quantize_dynamic_fp8(denoiser: Any, settings: DiffusionSettings) -> None:
    from genfast.quant.fp8 import quantize_dynamic_fp8
    from genfast.quant.linear import narrower_than

    quantize_dynamic_fp8(denoiser, keep=narrower_than(settings.int8_min_features))


def _quantize_int8_convs(model: Any, settings: DiffusionSettings) -> None:
    from genfast.quant.conv import fewer_channels_than, quantize_dynamic_int8_convs

    quantize_dynamic_int8_convs(model, keep=fewer_channels_than(settings.int8_conv_min_channels))


def _channels_last_group_norm(model: Any, settings: DiffusionSettings) -> None:
    from genfast.diffusion.group_norm import use_channels_last_group_norm

    use_channels_last_group_norm(model)


def _compile_options(settings: DiffusionSettings) -> dict[str, Any]:
    return {"dynamic": settings.dynamic_shapes, "saved": settings_key(settings), "max_autotune": settings.max_autotune}


def _compile_denoiser(denoiser: Any, settings: DiffusionSettings) -> None:
    """The whole denoiser, or (regional) each of its repeated blocks."""
    from genfast.diffusion.compiling import compile_module, compile_regions

    compile = compile_regions if settings.compile == "regional" else compile_module
    compile(denoiser, **_compile_options(settings))


def _compile_vae_decoder(vae: Any, settings: DiffusionSettings) -> None:
    from genfast.diffusion.compiling import compile_vae_decoder

    compile_vae_decoder(vae, **_compile_options(settings))


def _cache_features(pipe: Any, settings: DiffusionSettings) -> None:
    """DeepCache around a UNet, the block cache around a transformer."""
    from genfast.diffusion.block_cache import BlockCache
    from genfast.diffusion.feature_cache import DeepCacheUNet
    from genfast.diffusion.pipelines import denoiser_name, denoiser_of

    denoiser, interval = denoiser_of(pipe), settings.feature_cache_interval
    if type(denoiser).__name__ == UNET:
        cached = DeepCacheUNet(denoiser, pipe.scheduler, interval)
    else:
        cached = BlockCache(
            denoiser,
            pipe.scheduler,
            settings.block_cache_threshold,
            settings.block_cache_warmup,
            interval,
            front=settings.block_cache_front,
            back=settings.block_cache_back,
        )
    setattr(pipe, denoiser_name(pipe), cached)


COMPILE = (
    Transform(_compile_denoiser, ("denoiser",), Stage.COMPILE),
    Transform(_compile_vae_decoder, ("vae",), Stage.COMPILE),
)
EXACT = "fp32 max abs diff <= 1e-4; cumulative: as bf16"
RECIPE = Recipe(
    "diffusion",
    DiffusionSettings,
    [
        steps.baseline(
            "fp32, attention by explicit softmax (AttnProcessor; SD3 and Flux: SDPA's math backend), eager",
            [
                Transform(_cast, ("pipe",), Stage.PRECISION),
                Transform(_set_attention, MODELS, Stage.KERNELS),
                Transform(_fp32_products, ("pipe",), Stage.PRODUCTS),
            ],
        ),
        steps.bf16("PSNR >= 35 dB (tiny models: ~48)", fallback=_fp32_products_note),
        Step(
            "sdpa",
            "F.scaled_dot_product_attention: AttnProcessor2_0, JointAttnProcessor2_0 (SD3), backend 'native' (Flux)",
            EXACT,
            {"attention": "sdpa"},
        ),
        Step(
            "channels-last",
            "denoiser and VAE weights and activations in NHWC",
            EXACT,
            {"channels_last": True},
            fallback=_vae_only_note,
            transforms=(Transform(_channels_last, MODELS, Stage.LAYOUT),),
        ),
        Step(
            "fused-qkv",
            "one QKV (self-) / KV (cross-attention) linear, one for each stream of joint attention (SD3, Flux): "
            "diffusers' fuse_qkv_projections",
            EXACT,
            {"fuse_qkv": True},
            declined=_fused_qkv_declined,
            transforms=(Transform(_fuse_qkv, MODELS, Stage.REWRITE),),
        ),
        Step(
            "fused-attention",
            "FLUX.1's and SD3's attention by genfast's native CPU kernel (AVX-512: bf16 dot products, or "
            "fp32 FMAs where those are slower; AVX2: fp32) instead of SDPA; other denoisers keep SDPA",
            "as bf16 (fp32 on AVX-512: SDPA, exact)",
            {"attention_kernel": True},
            fallback=_attention_kernel_note,
            transforms=(Transform(_use_attention_kernel, ("denoiser",), Stage.REWRITE),),
        ),
        Step(
            "conv1x1-linear",
            "every 1x1 Conv2d of denoiser and VAE runs as a Linear over channels",
            EXACT,
            {"conv1x1_linear": True},
            fallback=_vae_only_note,
            transforms=(Transform(_conv1x1_to_linear, MODELS, Stage.REWRITE),),
        ),
        steps.compile_step(
            "torch.compile (fullgraph) of the denoiser and the VAE decoder",
            "as bf16 (fp32: max abs diff <= 1e-3)",
            {"compile": "full"},
            COMPILE,
        ),
        steps.dynamic_int8(
            "int8 activations x int8 weights in the denoiser's linears of >= 320 features",
            "PSNR >= 35 dB (tiny models, every linear quantized: 45-53)",
            {"dynamic_int8": True},
            [Transform(_quantize_dynamic_int8, ("denoiser",), Stage.QUANTIZE)],
        ),
        Step(
            "dynamic-fp8",
            "instead of dynamic-int8, on GPUs with fp8 tensor cores (compute capability 8.9+): fp8 (e4m3) "
            "activations x fp8 weights in the same linears, a scale per token and per output channel "
            "(torch._scaled_mm), as flux-fast quantizes FLUX.1",
            "PSNR >= 30 dB (tiny models, every linear quantized: 34-44)",
            {"dynamic_fp8": True},
            declined=_fp8_declined,
            replaces=("dynamic-int8",),
            transforms=(Transform(_quantize_dynamic_fp8, ("denoiser",), Stage.QUANTIZE),),
        ),
        Step(
            "int8-conv",
            "uint8 activations x int8 weights in the denoiser's and VAE decoder's convolutions of "
            ">= 128 channels (oneDNN)",
            "PSNR >= 35 dB (tiny models, every conv quantized)",
            {"int8_conv": True},
            needs=_int8_conv_unavailable,
            fallback=_vae_only_note,
            transforms=(Transform(_quantize_int8_convs, ("denoiser", "vae_decoder"), Stage.QUANTIZE),),
        ),
        Step(
            "group-norm-kernel",
            "GroupNorm of channels-last activations by genfast's native CPU kernel",
            "fp32 max abs diff <= 1e-4; cumulative: as int8-conv",
            {"group_norm_kernel": True},
            needs=_group_norm_kernel_unavailable,
            fallback=_vae_only_note,
            transforms=(Transform(_channels_last_group_norm, MODELS, Stage.KERNELS),),
        ),
        Step(
            "regional-compile",
            "instead of whole-model compile: each repeated block (transformer and residual blocks) compiled",
            "as dynamic-int8",
            {"compile": "regional"},
            transforms=COMPILE,
        ),
        Step(
            "dynamic-shapes",
            "the compiled regions and VAE decoder take symbolic sizes: a new resolution does not recompile",
            "as dynamic-int8",
            {"dynamic_shapes": True},
        ),
        Step(
            "feature-cache",
            "UNets: DeepCache, deep features reused every other step; transformers (FLUX.1, SD3, PixArt): "
            "first-block residual cache (cache-dit's F1B0; block_cache_front and block_cache_back set Fn and Bn), "
            "the other blocks skipped at most every other step, when the first block's residual changed < "
            f"{BLOCK_CACHE_THRESHOLD} since the last full step",
            "not accuracy-preserving: PSNR >= 30 dB vs the same recipe uncached on tiny models (UNets: ~50; "
            "transformers: see tests/diffusion/test_block_cache.py)",
            {"feature_cache": True},
            needs=_feature_cache_unavailable,
            transforms=(Transform(_cache_features, ("pipe",), Stage.WRAP),),
            tunes=(
                "feature_cache_interval",
                "block_cache_threshold",
                "block_cache_warmup",
                "block_cache_front",
                "block_cache_back",
            ),
        ),
    ],
)


def validate(settings: DiffusionSettings, pipe: Any = None) -> None:
    """Reject combinations that cannot run (on `pipe`, when given), before anything is changed."""
    if settings.compile not in COMPILE_MODES:
        raise UserError(f"unknown compile mode {settings.compile!r}; choose one of {', '.join(COMPILE_MODES)}")
    if settings.feature_cache and settings.compile == "full":
        raise UserError(
            "the feature cache runs the denoiser's blocks one by one: use regional compilation, not whole-denoiser "
            "compile"
        )
    if settings.dynamic_shapes and settings.compile == "none":
        raise UserError("dynamic_shapes is a compile option: it needs compile 'full' or 'regional'")
    if settings.feature_cache_interval < 1:
        raise UserError(f"feature_cache_interval must be >= 1, got {settings.feature_cache_interval}")
    if settings.block_cache_threshold < 0 or settings.block_cache_warmup < 1:
        raise UserError(
            f"block_cache_threshold must be >= 0 and block_cache_warmup >= 1, got {settings.block_cache_threshold} "
            f"and {settings.block_cache_warmup}"
        )
    if settings.block_cache_front < 1 or settings.block_cache_back < 0:
        raise UserError(
            f"block_cache_front must be >= 1 and block_cache_back >= 0, got {settings.block_cache_front} and "
            f"{settings.block_cache_back}"
        )
    if settings.attention_kernel and settings.attention != "sdpa":
        raise UserError("the attention kernel replaces SDPA: it needs attention 'sdpa'")
    if settings.fuse_qkv and settings.attention != "sdpa":
        raise UserError("fused QKV uses diffusers' FusedAttnProcessor2_0 (SDPA): it needs attention 'sdpa'")
    if settings.dynamic_int8 and settings.dynamic_fp8:
        raise UserError(
            "dynamic_int8 and dynamic_fp8 both quantize the denoiser's linears: choose one (the recipe's "
            "dynamic-fp8 step replaces dynamic-int8)"
        )
    if pipe is None:
        return
    if getattr(pipe, "vae", None) is None:
        raise UserError(f"{type(pipe).__name__} has no `vae`: genfast's steps do not apply")
    if settings.dynamic_fp8:
        from genfast.diffusion.pipelines import denoiser_of
        from genfast.quant.fp8 import unavailable_reason

        if reason := unavailable_reason(next(denoiser_of(pipe).parameters()).device):
            raise UserError(f"dynamic_fp8 cannot run here: {reason}")


def apply_recipe(pipe: Any, settings: DiffusionSettings) -> Any:
    """Make a freshly loaded diffusers pipeline run as `settings` say, in place (and return it):
    the recipe's transforms (genfast/recipe.py), in their stages' order: processors before fusing,
    shape changes (fusing, conv->linear, int8) before compiling, the feature cache around the
    (regionally compiled) denoiser last. A step the pipeline cannot take (feature-cache on a
    denoiser it does not know) is refused before anything changes."""
    from genfast.diffusion.pipelines import denoiser_of

    validate(settings, pipe)
    denoiser = denoiser_of(pipe)
    parts = {"pipe": pipe, "denoiser": denoiser, "vae": pipe.vae, "vae_decoder": getattr(pipe.vae, "decoder", pipe.vae)}
    RECIPE.apply(settings, parts, pipeline_target(pipe, settings.dtype))
    return pipe
