"""FLUX.1 and Stable Diffusion 3.5 pipelines at their real sizes with random weights, for benchmarks.

Each architecture is the fields of its published diffusers configs (the `config.json` of the
transformer, VAE, text encoders and scheduler on the hub, cited at each dict). Speed does not
depend on weight values, so the weights are random; no hub is reachable here.

Memory decides how they are built. FLUX.1's transformer alone has 11.9 G parameters (47.6 GB in
fp32) and T5-XXL's encoder 4.76 G, so a pipeline is never built in fp32 and cast: every module's
weights are allocated and drawn in the requested dtype (bf16 by default) as it is built (torch's
default dtype is set for the build), seeded per component. A fp32 row casts those bf16 weights up,
so every precision computes with the same weights.

`blocks` builds fewer transformer blocks at the real width (per-step timing on a 2-core CPU):
FLUX.1's double- and single-stream blocks keep their 1:2 ratio, SD 3.5-medium's dual-attention
blocks their share, and the text encoders keep the same fraction of their layers (at least one),
so T5-XXL is not a 4.76 G-parameter constant in a 3-block timing. The VAE is always whole.
The tiny byte tokenizer (pipelines._tiny_tokenizer) stands in for CLIP's and T5's: its ids are a
subset of both vocabularies, and T5's prompts are padded to the real sequence lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

# ---- published configs (the fields that fix the architecture and its cost) ----

# black-forest-labs/FLUX.1-schnell and FLUX.1-dev, transformer/config.json: identical but for
# guidance_embeds (dev is guidance-distilled: the guidance scale is an input embedding, no CFG).
_FLUX_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,  # 16 latent channels in 2x2 patches
    num_layers=19,  # double-stream (MMDiT) blocks
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,  # T5-XXL's width
    pooled_projection_dim=768,  # CLIP-L's pooled output
    axes_dims_rope=(16, 56, 56),
)
# black-forest-labs/FLUX.1-{schnell,dev} vae/config.json (the two files are identical) and
# stabilityai/stable-diffusion-3.5-{medium,large} vae/config.json: the same 16-channel autoencoder,
# with its own latent scale and shift.
_FLOW_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    norm_num_groups=32,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    sample_size=1024,
    force_upcast=True,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
_FLUX_VAE = dict(_FLOW_VAE, scaling_factor=0.3611, shift_factor=0.1159)
_SD35_VAE = dict(_FLOW_VAE, scaling_factor=1.5305, shift_factor=0.0609)
# stabilityai/stable-diffusion-3.5-medium transformer/config.json: MMDiT-X, whose first 13 blocks
# add a second self-attention over the image tokens (dual attention).
_SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,  # CLIP-L's 768 + CLIP-G's 1280 projections
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
# stabilityai/stable-diffusion-3.5-large transformer/config.json.
_SD35_LARGE_TRANSFORMER = dict(
    _SD35_MEDIUM_TRANSFORMER,
    num_layers=38,
    num_attention_heads=38,
    caption_projection_dim=2432,
    pos_embed_max_size=192,
    dual_attention_layers=(),
)
# text_encoder/config.json of FLUX.1 (CLIPTextModel) and SD 3.5 (CLIPTextModelWithProjection):
# openai/clip-vit-large-patch14's text tower.
CLIP_L = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_attention_heads=12,
    num_hidden_layers=12,
    projection_dim=768,
    hidden_act="quick_gelu",
)
# SD 3.5's text_encoder_2/config.json: OpenCLIP bigG's text tower (CLIP-G).
CLIP_G = dict(
    hidden_size=1280,
    intermediate_size=5120,
    num_attention_heads=20,
    num_hidden_layers=32,
    projection_dim=1280,
    hidden_act="gelu",
)
# FLUX.1's text_encoder_2/config.json and SD 3.5's text_encoder_3/config.json: google/t5-v1_1-xxl's
# encoder (T5EncoderModel), gated-GELU feed-forwards, untied embeddings.
T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    tie_word_embeddings=False,
)
# scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler): schnell's fixed shift 1,
# dev's resolution-dependent shift, SD 3.5's fixed shift 3.
_FLUX_SCHEDULE = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15)
_FLUX_SCHNELL_SCHEDULER = dict(_FLUX_SCHEDULE, num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
_FLUX_DEV_SCHEDULER = dict(_FLUX_SCHEDULE, num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
_SD35_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)


@dataclass(frozen=True)
class DitArch:
    """One architecture: its components' published configs and how its model card runs it."""

    name: str
    family: str  # "flux" (FluxPipeline) or "sd3" (StableDiffusion3Pipeline)
    transformer: dict[str, Any]
    vae: dict[str, Any]
    scheduler: dict[str, Any]
    # The pipeline's text encoders: component name -> (transformers class name, config fields).
    text_encoders: dict[str, tuple[str, dict[str, Any]]]
    # The pipeline call's arguments as the model card uses them (guidance, T5 sequence length).
    call: dict[str, Any] = field(default_factory=dict)
    bench_blocks: int = 2  # `genfast bench diffusion`'s default block count: what a 2-core CPU can time

    @property
    def full_blocks(self) -> int:
        return self.transformer["num_layers"] + self.transformer.get("num_single_layers", 0)

    def depth(self, blocks: int | None) -> Depth:
        """The block and text-encoder layer counts for `blocks` transformer blocks (None: full depth)."""
        full = self.full_blocks
        blocks = full if blocks is None else blocks
        if not 1 <= blocks <= full:
            raise ValueError(
                f"{self.name} has {full} transformer blocks: blocks must be between 1 and {full}, got {blocks}"
            )
        fraction = blocks / full
        if self.family == "flux":
            double = max(1, round(blocks * self.transformer["num_layers"] / full))
            transformer = {"num_layers": double, "num_single_layers": blocks - double}
        else:
            dual = len(self.transformer["dual_attention_layers"])
            shared = round(dual * fraction) if dual else 0
            transformer = {"num_layers": blocks, "dual_attention_layers": tuple(range(shared))}
        encoders = {name: max(1, round(_layers(fields) * fraction)) for name, (_, fields) in self.text_encoders.items()}
        return Depth(blocks, full, transformer, encoders)


@dataclass(frozen=True)
class Depth:
    """How deep one build is: `transformer` overrides the transformer config's block fields,
    `encoders` gives each text encoder's layer count."""

    blocks: int
    full_blocks: int
    transformer: dict[str, Any]
    encoders: dict[str, int]

    def describe(self) -> str:
        """e.g. "3 of 57 blocks (1 double-stream + 2 single-stream); text encoder layers: text_encoder 1,
        text_encoder_2 1"."""
        if self.blocks == self.full_blocks:
            return f"all {self.full_blocks} blocks"
        kinds = ""
        if "num_single_layers" in self.transformer:
            t = self.transformer
            kinds = f" ({t['num_layers']} double-stream + {t['num_single_layers']} single-stream)"
        layers = ", ".join(f"{name} {n}" for name, n in self.encoders.items())
        return f"{self.blocks} of {self.full_blocks} blocks{kinds}; text encoder layers: {layers}"


def _layers(fields: dict[str, Any]) -> int:
    """A text encoder config's layer count (CLIP's and T5's field names)."""
    return fields["num_hidden_layers"] if "num_hidden_layers" in fields else fields["num_layers"]


# FLUX.1 conditions on CLIP-L's pooled output and T5's sequence; SD 3.5 on both CLIPs' projections
# and T5's sequence.
_FLUX_ENCODERS = {"text_encoder": ("CLIPTextModel", CLIP_L), "text_encoder_2": ("T5EncoderModel", T5_XXL)}
_SD35_ENCODERS = {
    "text_encoder": ("CLIPTextModelWithProjection", CLIP_L),
    "text_encoder_2": ("CLIPTextModelWithProjection", CLIP_G),
    "text_encoder_3": ("T5EncoderModel", T5_XXL),
}

# FLUX.1-schnell: 4 steps, no guidance, T5 prompts of 256 tokens (its model card); FLUX.1-dev: the
# guidance embedding at 3.5, 512 tokens; SD 3.5: classifier-free guidance (diffusers' default 7.0,
# a batch of two), 256 tokens. The default block counts are for per-step timing on a 2-core CPU.
ARCHS: dict[str, DitArch] = {
    "flux-schnell": DitArch(
        "flux-schnell",
        "flux",
        dict(_FLUX_TRANSFORMER, guidance_embeds=False),
        _FLUX_VAE,
        _FLUX_SCHNELL_SCHEDULER,
        _FLUX_ENCODERS,
        call={"guidance_scale": 0.0, "max_sequence_length": 256},
        bench_blocks=3,
    ),
    "flux-dev": DitArch(
        "flux-dev",
        "flux",
        dict(_FLUX_TRANSFORMER, guidance_embeds=True),
        _FLUX_VAE,
        _FLUX_DEV_SCHEDULER,
        _FLUX_ENCODERS,
        call={"guidance_scale": 3.5, "max_sequence_length": 512},
        bench_blocks=3,
    ),
    "sd35-medium": DitArch(
        "sd35-medium",
        "sd3",
        _SD35_MEDIUM_TRANSFORMER,
        _SD35_VAE,
        _SD35_SCHEDULER,
        _SD35_ENCODERS,
        call={"guidance_scale": 7.0, "max_sequence_length": 256},
        bench_blocks=4,
    ),
    "sd35-large": DitArch(
        "sd35-large",
        "sd3",
        _SD35_LARGE_TRANSFORMER,
        _SD35_VAE,
        _SD35_SCHEDULER,
        _SD35_ENCODERS,
        call={"guidance_scale": 7.0, "max_sequence_length": 256},
        bench_blocks=2,
    ),
}


def arch(name: str | DitArch) -> DitArch:
    if isinstance(name, DitArch):
        return name
    if name not in ARCHS:
        raise ValueError(f"unknown DiT architecture {name!r}; choose one of {', '.join(ARCHS)}")
    return ARCHS[name]


@contextmanager
def _building_in(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside allocate and initialize their weights in `dtype` (torch's default
    dtype): a bf16 model never exists in fp32, not even one layer at a time."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _builders(spec: DitArch, blocks: int | None) -> dict[str, Callable[[], torch.nn.Module]]:
    """How to build each of the architecture's models (by pipeline component name), in the current
    default device and dtype, eval mode."""
    depth = spec.depth(blocks)
    encoders = {
        name: partial(_text_encoder, *spec.text_encoders[name], layers) for name, layers in depth.encoders.items()
    }
    return {"transformer": partial(_transformer, spec, depth), "vae": partial(_vae, spec), **encoders}


def _transformer(spec: DitArch, depth: Depth) -> torch.nn.Module:
    cls, config = transformer_spec(spec, depth.blocks)
    return cls(**config).eval()


def _vae(spec: DitArch) -> torch.nn.Module:
    import diffusers

    return diffusers.AutoencoderKL(**spec.vae).eval()


def _text_encoder(kind: str, fields: dict[str, Any], layers: int) -> torch.nn.Module:
    import transformers

    if kind == "T5EncoderModel":
        # The tiny tokenizer pads with id 513, a valid id of T5's 32128.
        config = transformers.T5Config(**{**fields, "num_layers": layers}, pad_token_id=513, eos_token_id=513)
    else:
        # The real vocabulary has 49408 tokens; the tiny byte tokenizer's ids are a valid subset.
        config = transformers.CLIPTextConfig(
            **{**fields, "num_hidden_layers": layers},
            vocab_size=49408,
            max_position_embeddings=77,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
        )
    return getattr(transformers, kind)(config).eval()


def parameter_counts(name: str | DitArch, blocks: int | None = None) -> dict[str, int]:
    """Elements of each model's weights as a checkpoint stores them (parameters, tied ones once,
    and persistent buffers: SD 3.5's position-embedding table is one), from the configs alone:
    built on the meta device, without memory."""
    return {part: _elements(model) for part, model in empty_models(name, blocks).items()}


def empty_models(name: str | DitArch, blocks: int | None = None) -> dict[str, torch.nn.Module]:
    """Each of the architecture's models (by pipeline component name) on the meta device: their
    shapes without memory (genfast/diffusion/memory.py counts their bytes)."""
    with torch.device("meta"):
        return {part: build() for part, build in _builders(arch(name), blocks).items()}


def transformer_spec(name: str | DitArch, blocks: int | None = None) -> tuple[type, dict[str, Any]]:
    """The transformer's diffusers class and config, as a directory's transformer/config.json
    gives them (genfast/diffusion/loading.py builds it from them)."""
    import diffusers

    spec = arch(name)
    cls = diffusers.FluxTransformer2DModel if spec.family == "flux" else diffusers.SD3Transformer2DModel
    return cls, {**spec.transformer, **spec.depth(blocks).transformer}


def _elements(module: torch.nn.Module) -> int:
    stored = module.state_dict().keys()
    buffers = sum(b.numel() for name, b in module.named_buffers() if name in stored)
    return sum(p.numel() for p in module.parameters()) + buffers


def build_pipeline(
    name: str | DitArch,
    blocks: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    tokenizer: Any = None,
    transformer: bool = True,
) -> Any:
    """A FluxPipeline or StableDiffusion3Pipeline of architecture `name` with random weights drawn
    in `dtype` on `device`, the same ones for the same seed, device and dtype. `tokenizer` serves
    every text encoder (pipelines._tiny_tokenizer). `transformer=False`: without its transformer
    (None), which the caller draws otherwise (in parts, quantized: genfast/diffusion/loading.py)
    from `seed`, the transformer's seed here."""
    import diffusers

    spec = arch(name)
    device = torch.device(device)
    models: dict[str, torch.nn.Module] = {}
    forked = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), device, _building_in(dtype):
        # Each model from its own seed: the transformer's weights do not depend on how deep the
        # text encoders are built.
        for offset, (part, build) in enumerate(_builders(spec, blocks).items()):
            if part == "transformer" and not transformer:
                continue
            torch.manual_seed(seed + offset)
            models[part] = build()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**spec.scheduler)
    tokenizers = {name.replace("text_encoder", "tokenizer"): tokenizer for name in spec.text_encoders}
    pipeline = diffusers.FluxPipeline if spec.family == "flux" else diffusers.StableDiffusion3Pipeline
    pipe = pipeline(scheduler=scheduler, **{"transformer": None, **models}, **tokenizers)
    pipe.set_progress_bar_config(disable=True)
    return pipe
