"""Loading diffusers pipelines, and tiny random ones for tests.

genfast does not re-implement UNets or VAEs: diffusers is the standard, and the recipe
(genfast.diffusion.recipe) is applied to its pipelines. `tiny_pipeline` builds SD 1.5-, SDXL- and
PixArt-α-shaped pipelines from configs with random weights (no hub is reachable here), with a
tokenizer whose vocabulary is the 256 byte symbols of CLIP's BPE and no merges, so prompts work.
"""

from __future__ import annotations

import inspect
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from genfast.diffusion.transformer_archs import CLIP_G, CLIP_L  # also SD 1.5's and SDXL's text encoders
from genfast.errors import UserError

TINY_ARCHS = ("sd15", "sdxl", "pixart", "flux", "sd3")


def _import_diffusers() -> Any:
    try:
        import diffusers
    except ImportError as e:  # an optional extra: say how to get it
        raise UserError("diffusion needs the diffusers package: pip install 'genfast[diffusion]'") from e
    return diffusers


def denoiser_of(pipe: Any) -> torch.nn.Module:
    """The pipeline's denoiser: its `unet` or, for DiT pipelines (PixArt, SD3, Flux), `transformer`."""
    for name in ("unet", "transformer"):
        module = getattr(pipe, name, None)
        if module is not None:
            return module
    raise ValueError(f"{type(pipe).__name__} has neither a `unet` nor a `transformer`: genfast's steps do not apply")


class DenoiserWrapper(torch.nn.Module):
    """Stands in for a pipeline's denoiser (set as its `unet`/`transformer`): attributes the
    wrapper does not have (`config`, `dtype`, `add_embedding`, ...) are the wrapped module's, so
    the pipeline works unchanged."""

    def __init__(self, denoiser: torch.nn.Module) -> None:
        super().__init__()
        self.denoiser = denoiser

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["denoiser"], name)


def denoiser_name(pipe: Any) -> str:
    return "unet" if getattr(pipe, "unet", None) is not None else "transformer"


def load_pipeline(
    model: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", without: tuple[str, ...] = ()
) -> Any:
    """A diffusers pipeline from a local directory (diffusers layout, with model_index.json) or a
    hub id (downloaded by diffusers when the hub is reachable). The components named in `without`
    are left out (None), to be loaded otherwise (genfast/diffusion/loading.py)."""
    diffusers = _import_diffusers()
    path = Path(model).expanduser()
    looks_local = is_local(model)
    if looks_local:
        if not path.is_dir():
            raise UserError(
                f"{model} is not a directory: pass a diffusers pipeline directory (with model_index.json) or a hub id"
            )
        if not (path / "model_index.json").is_file():
            raise UserError(f"{path} has no model_index.json: it is not a diffusers pipeline directory")
        source = str(path)
    else:
        source = model
    try:
        with _transformers_errors_only():
            pipe = diffusers.DiffusionPipeline.from_pretrained(source, dtype=dtype, **dict.fromkeys(without))
    except (OSError, ValueError) as e:
        where = "the directory's components" if looks_local else f"hub id {model!r} (is the hub reachable?)"
        raise UserError(f"could not load a diffusers pipeline from {where}: {str(e).splitlines()[0]}") from e
    return pipe.to(device)


def is_local(model: str) -> bool:
    """Whether `model` names a local path rather than a hub id ("org/name")."""
    return Path(model).expanduser().exists() or model.startswith((".", "/", "~")) or model.count("/") > 1


def download_pipeline(hub_id: str) -> Path:
    """The directory, in the hub cache, of a hub id's pipeline: the files DiffusionPipeline's
    from_pretrained would load (the components model_index.json names, not the single-file
    checkpoints a repository may hold beside them), fetched where missing. Loading from it is then
    loading a local directory: in parts with --quant int8, and checked against memory first."""
    diffusers = _import_diffusers()
    try:
        with _transformers_errors_only():
            return Path(diffusers.DiffusionPipeline.download(hub_id))
    except (OSError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"could not download hub id {hub_id!r} (is the hub reachable?): {reason}") from e


@contextmanager
def _transformers_errors_only() -> Iterator[None]:
    """Loading a pipeline imports transformers' image processors, which warn on every run that
    torchvision is missing and they fall back to PIL: nothing genfast uses, nothing to act on."""
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins GPT-2/CLIP byte-level BPE uses for the bytes 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _tiny_tokenizer() -> Any:
    """A CLIPTokenizer over the 256 byte symbols of CLIP's byte-level BPE (plain and word-final)
    and no merges: every prompt tokenizes, one token per byte. It reads its files when built, so
    they live in a directory removed right after."""
    from transformers import CLIPTokenizer

    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    with tempfile.TemporaryDirectory(prefix="genfast-tokenizer-") as name:
        directory = Path(name)
        (directory / "vocab.json").write_text(json.dumps(vocab))
        (directory / "merges.txt").write_text("#version: 0.2\n")
        return CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"), model_max_length=77)


def _tiny_text_encoder(projection: bool, hidden_size: int, seed: int) -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        bos_token_id=512,
        eos_token_id=513,
        pad_token_id=513,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=4,
        num_hidden_layers=2,
        projection_dim=hidden_size,
        vocab_size=514,
        max_position_embeddings=77,
        hidden_act="gelu",
    )
    torch.manual_seed(seed)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _tiny_vae(seed: int) -> torch.nn.Module:
    diffusers = _import_diffusers()
    torch.manual_seed(seed)
    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        sample_size=32,
    ).eval()


def _tiny_pixart(seed: int, tokenizer: Any) -> Any:
    """PixArt-α's layout (a DiT with adaLN-single, a T5 encoder, DPM-Solver) at toy widths."""
    diffusers = _import_diffusers()
    torch.manual_seed(seed)
    transformer = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        cross_attention_dim=16,
        sample_size=16,
        patch_size=2,
        caption_channels=32,
        norm_num_groups=8,
    ).eval()
    text_encoder = _tiny_t5(seed + 2, 32, gated=False)
    return diffusers.PixArtAlphaPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=_tiny_vae(seed + 1),
        transformer=transformer,
        scheduler=diffusers.DPMSolverMultistepScheduler(),
    )


def _tiny_t5(seed: int, d_model: int, gated: bool = True) -> torch.nn.Module:
    """A 2-layer T5 encoder; gated-GELU feed-forwards as T5 v1.1 (FLUX.1's and SD3's T5-XXL)."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=514, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=4, pad_token_id=513,
        eos_token_id=513, feed_forward_proj="gated-gelu" if gated else "relu",
    )  # fmt: skip
    return T5EncoderModel(config).eval()


def _tiny_flow_vae(seed: int, latent_channels: int) -> torch.nn.Module:
    """The VAE of flow-matching pipelines: more latent channels, no quant convs, a shift."""
    diffusers = _import_diffusers()
    torch.manual_seed(seed)
    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1,
        scaling_factor=1.5,
    ).eval()


def _tiny_flux(seed: int, tokenizer: Any) -> Any:
    """FLUX.1's layout (double- and single-stream blocks, 3-axis RoPE, packed 2x2 latents, CLIP's
    pooled and T5's sequence embeddings, guidance embedding as in -dev) at toy widths."""
    diffusers = _import_diffusers()
    torch.manual_seed(seed)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * 4,  # 4 latent channels in 2x2 patches
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    ).eval()
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=_tiny_flow_vae(seed + 1, 4),
        text_encoder=_tiny_text_encoder(False, 32, seed + 2),
        tokenizer=tokenizer,
        text_encoder_2=_tiny_t5(seed + 3, 32),
        tokenizer_2=tokenizer,
        transformer=transformer,
    )


def _tiny_sd3(seed: int, tokenizer: Any) -> Any:
    """Stable Diffusion 3.5's layout (MMDiT with RMS-normed q/k, one dual-attention layer as
    in 3.5-medium, two CLIPs and a T5) at toy widths."""
    diffusers = _import_diffusers()
    torch.manual_seed(seed)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,  # T5's width; the CLIPs' 32 + 32 are padded to it
        caption_projection_dim=32,
        pooled_projection_dim=64,  # the two CLIPs' projections, concatenated
        out_channels=4,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    ).eval()
    return diffusers.StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_tiny_flow_vae(seed + 1, 4),
        text_encoder=_tiny_text_encoder(True, 32, seed + 2),
        tokenizer=tokenizer,
        text_encoder_2=_tiny_text_encoder(True, 32, seed + 3),
        tokenizer_2=tokenizer,
        text_encoder_3=_tiny_t5(seed + 4, 64),
        tokenizer_3=tokenizer,
    )


TINY_BUILDERS = {"pixart": _tiny_pixart, "flux": _tiny_flux, "sd3": _tiny_sd3}

# PixArt pipelines snap the requested size to an aspect-ratio table chosen by the transformer's
# sample size; a transformer of another sample size (the tiny PixArt's 16) has no table.
RESOLUTION_BIN_SAMPLE_SIZES = (32, 64, 128)


def call_kwargs(pipe: Any) -> dict[str, Any]:
    """Pipeline-specific call arguments: resolution binning off where the pipeline has no table."""
    if _bins_resolution(pipe) and denoiser_of(pipe).config.sample_size not in RESOLUTION_BIN_SAMPLE_SIZES:
        return {"use_resolution_binning": False}
    return {}


def _bins_resolution(pipe: Any) -> bool:
    return "use_resolution_binning" in inspect.signature(pipe.__call__).parameters


def _latent_size(pipe: Any, height: int, width: int) -> tuple[int, int]:
    """The height and width the pipeline generates at when asked for `height` x `width` (PixArt
    snaps them to its aspect-ratio table, and resizes the image back at the end; Flux rounds them
    down to whole 2x2 patches of latents, with a warning)."""
    if _packs_latents(pipe):
        step = 2 * pipe.vae_scale_factor
        return height // step * step, width // step * step
    if not _bins_resolution(pipe) or call_kwargs(pipe):
        return height, width
    from diffusers.pipelines.pixart_alpha import pipeline_pixart_alpha as pixart

    tables = {128: pixart.ASPECT_RATIO_1024_BIN, 64: pixart.ASPECT_RATIO_512_BIN, 32: pixart.ASPECT_RATIO_256_BIN}
    table = tables[denoiser_of(pipe).config.sample_size]
    return pipe.image_processor.classify_height_width_bin(height, width, ratios=table)


def native_size(pipe: Any) -> tuple[int, int]:
    """The (width, height) the pipeline's denoiser was trained at, diffusers' default: the
    denoiser's sample size times the VAE's factor (512x512 for SD 1.5, 1024x1024 for SDXL and
    SD 3.5, 32x32 for the tiny test pipelines), or, where the denoiser has no sample size (Flux),
    the pipeline's `default_sample_size` (128: 1024x1024 for FLUX.1, 256x256 for the tiny one)."""
    sample = getattr(denoiser_of(pipe).config, "sample_size", None) or pipe.default_sample_size
    height, width = (sample, sample) if isinstance(sample, int) else sample
    return width * pipe.vae_scale_factor, height * pipe.vae_scale_factor


def size_multiple(pipe: Any) -> int:
    """What the image's sides must be multiples of for the pipeline to generate at that size: the
    VAE's factor times the latent patch (Flux's 2x2 packing; SD3's and PixArt's patch embedding).
    Pipelines that snap the size to a table (PixArt's resolution binning) take any multiple of 8."""
    if _packs_latents(pipe):
        return 2 * pipe.vae_scale_factor
    if _bins_resolution(pipe) and not call_kwargs(pipe):
        return 8
    return pipe.vae_scale_factor * (getattr(denoiser_of(pipe).config, "patch_size", None) or 1)


def initial_latents(pipe: Any, height: int, width: int, seed: int, images: int = 1) -> torch.Tensor:
    """The noise a `seed` starts from, for the pipeline's `latents` argument: drawn in fp32 from a
    CPU generator, then cast to the denoiser's dtype and device. diffusers draws it in the
    pipeline's dtype, and torch's CPU sampler need not give bf16 noise that is fp32's rounded
    (torch 2.13's does; with 2.11's, on a GPU machine, every bf16 image of the tests and the bench
    was another image than its fp32 baseline, 12-13 dB apart): drawn here, a seed gives the same
    image in every precision. Flux takes its latents packed in 2x2 patches (`pipe._pack_latents`):
    they are drawn as an image of latents (in_channels / 4 channels) and packed, as FluxPipeline
    does, so an fp32 pipeline given a CPU generator of the same seed starts from the same noise."""
    denoiser = denoiser_of(pipe)
    height, width = _latent_size(pipe, height, width)
    factor = pipe.vae_scale_factor
    packs = _packs_latents(pipe)
    channels = denoiser.config.in_channels // 4 if packs else denoiser.config.in_channels
    shape = (images, channels, int(height) // factor, int(width) // factor)
    noise = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
    if packs:
        noise = pipe._pack_latents(noise, *shape)
    return noise.to(device=denoiser.device, dtype=denoiser.dtype)


def _packs_latents(pipe: Any) -> bool:
    """Whether the pipeline takes its latents packed in 2x2 patches: FluxTransformer2DModel's
    pipelines (the denoiser seen through genfast's wrappers, e.g. a test's or a cache's)."""
    denoiser = denoiser_of(pipe)
    while isinstance(denoiser, DenoiserWrapper):
        denoiser = denoiser.denoiser
    return type(denoiser).__name__ == "FluxTransformer2DModel" and hasattr(pipe, "_pack_latents")


def tiny_pipeline(arch: str = "sd15", seed: int = 0) -> Any:
    """A tiny random StableDiffusionPipeline ("sd15"), StableDiffusionXLPipeline ("sdxl"),
    PixArtAlphaPipeline ("pixart"), FluxPipeline ("flux") or StableDiffusion3Pipeline ("sd3") in
    fp32 on the CPU, with the architectures' features: cross-attention down/up blocks, resnets
    with 1x1 shortcuts, conv (sd15) or linear (sdxl) transformer projections, SDXL's second text
    encoder and time-id embedding; PixArt's DiT blocks and T5 encoder; FLUX.1's and SD 3.5's
    flow-matching transformers (see their builders). Images are 32x32 by default (latents 16x16:
    VAE factor 2); call the PixArt one with `call_kwargs(pipe)`."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    tokenizer = _tiny_tokenizer()
    if arch in TINY_BUILDERS:
        pipe = TINY_BUILDERS[arch](seed, tokenizer)
    else:
        pipe = _tiny_stable_diffusion(arch == "sdxl", seed, tokenizer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _tiny_stable_diffusion(sdxl: bool, seed: int, tokenizer: Any) -> Any:
    diffusers = _import_diffusers()
    torch.manual_seed(seed)
    unet = diffusers.UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64 if sdxl else 32,
        attention_head_dim=4 if sdxl else 8,
        use_linear_projection=sdxl,
        addition_embed_type="text_time" if sdxl else None,
        addition_time_embed_dim=8 if sdxl else None,
        projection_class_embeddings_input_dim=32 + 6 * 8 if sdxl else None,
    ).eval()
    vae = _tiny_vae(seed + 1)
    scheduler = diffusers.EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", timestep_spacing="leading", steps_offset=1
    )
    components: dict[str, Any] = dict(
        unet=unet,
        vae=vae,
        scheduler=scheduler,
        tokenizer=tokenizer,
        text_encoder=_tiny_text_encoder(False, 32, seed + 2),
    )
    if sdxl:
        components.update(tokenizer_2=tokenizer, text_encoder_2=_tiny_text_encoder(True, 32, seed + 3))
    return _stable_diffusion_pipeline(sdxl, components)


def _stable_diffusion_pipeline(sdxl: bool, components: dict[str, Any]) -> Any:
    """An SDXL or SD 1.5 pipeline from its components (SD 1.5 without a safety checker)."""
    diffusers = _import_diffusers()
    if sdxl:
        return diffusers.StableDiffusionXLPipeline(**components)
    return diffusers.StableDiffusionPipeline(
        **components, safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )


# Published component configs (diffusers' config.json of runwayml/stable-diffusion-v1-5 and
# stabilityai/stable-diffusion-xl-base-1.0), the fields that fix the architecture and its cost.
_SD15_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    cross_attention_dim=768,
    attention_head_dim=8,
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
)
_SDXL_UNET = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280),
    cross_attention_dim=2048,
    attention_head_dim=(5, 10, 20),
    transformer_layers_per_block=(1, 2, 10),
    use_linear_projection=True,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
)
_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
)
UNET_ARCHS = ("sd15", "sdxl")
# FLUX.1 and SD 3.5 (genfast.diffusion.transformer_archs, its ARCHS' names): built in bf16.
DIT_ARCHS = ("flux-schnell", "flux-dev", "sd35-medium", "sd35-large")
REAL_ARCHS = UNET_ARCHS + DIT_ARCHS


def _text_encoder(fields: dict, projection: bool) -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    # The real vocabulary has 49408 tokens; the tiny byte tokenizer's ids are a valid subset.
    config = CLIPTextConfig(
        vocab_size=49408, max_position_embeddings=77, bos_token_id=512, eos_token_id=513, pad_token_id=513, **fields
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def random_pipeline(
    arch: str,
    seed: int = 0,
    device: torch.device | str = "cpu",
    blocks: int | None = None,
    dtype: torch.dtype | None = None,
) -> Any:
    """A pipeline at a real architecture's size with random weights, for benchmarks: speed does
    not depend on weight values. SD 1.5 ("sd15") and SDXL ("sdxl") are drawn in fp32 (`dtype`);
    FLUX.1 ("flux-schnell", "flux-dev") and SD 3.5 ("sd35-medium", "sd35-large") in bf16 (`dtype`),
    module by module, never in fp32 (genfast.diffusion.transformer_archs), with `blocks`
    transformer blocks (None: all) and their text encoders cut to the same fraction of their
    layers. The weights are drawn on `device` (on a GPU in a fraction of the seconds SDXL's 3.5 G
    parameters take on a CPU), the same ones for the same seed, device and dtype. Prompts go
    through the tiny byte tokenizer (the real ones are not available offline)."""
    if arch not in REAL_ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(REAL_ARCHS)}")
    if arch in DIT_ARCHS:
        from genfast.diffusion.transformer_archs import build_pipeline

        dtype = torch.bfloat16 if dtype is None else dtype
        return build_pipeline(arch, blocks, seed, device, dtype, tokenizer=_tiny_tokenizer())
    if blocks is not None:
        raise ValueError(f"{arch} is a UNet: a block count applies only to {', '.join(DIT_ARCHS)}")
    diffusers = _import_diffusers()
    sdxl = arch == "sdxl"
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        unet = diffusers.UNet2DConditionModel(**(_SDXL_UNET if sdxl else _SD15_UNET)).eval()
        vae = diffusers.AutoencoderKL(**_VAE, sample_size=1024 if sdxl else 512).eval()
        text_encoder = _text_encoder(CLIP_L, projection=False)
        text_encoder_2 = _text_encoder(CLIP_G, projection=True) if sdxl else None
    scheduler = diffusers.EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", timestep_spacing="leading", steps_offset=1
    )
    tokenizer = _tiny_tokenizer()
    components: dict[str, Any] = dict(
        unet=unet, vae=vae, scheduler=scheduler, tokenizer=tokenizer, text_encoder=text_encoder
    )
    if sdxl:
        components.update(tokenizer_2=tokenizer, text_encoder_2=text_encoder_2)
    pipe = _stable_diffusion_pipeline(sdxl, components)
    if dtype is not None:
        pipe.to(dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe
