"""Build SAM 2 models from a config, and load their weights: the official checkpoints
(`sam2.1_hiera_tiny.pt` ...: {"model": state dict}) or Hugging Face's transformers layout (a folder
with config.json and model.safetensors).

A checkpoint's shapes tell its Hiera trunk (width, blocks per stage, position table) and release
(2.1 has tensors 2.0 lacks), but not its head counts or which blocks attend globally: those are
taken from the official preset with the same shapes; anything else needs its config passed.
"""

from __future__ import annotations

import json
import re
from itertools import pairwise
from pathlib import Path

import torch
from torch import Tensor

from genfast.errors import UserError
from genfast.sam.build import is_state_dict, read_checkpoint_file, with_random_weights
from genfast.sam.sam2.config import SAM2_PRESETS, Sam2Config, sam2_preset
from genfast.sam.sam2.modeling.model import Sam2

_PATCH_KEY = "image_encoder.trunk.patch_embed.proj.weight"
# genfast reuses SAM's two-way transformer, whose MLPs name their layers lin1/lin2.
_TRANSFORMER_MLP = re.compile(r"^(sam_mask_decoder\.transformer\.layers\.\d+\.mlp\.)layers\.([01])\.")


def build_sam2(config: Sam2Config | str) -> Sam2:
    """A SAM 2 model with freshly initialized weights (a preset name or a config), in eval mode."""
    if isinstance(config, str):
        config = sam2_preset(config)
    return Sam2(config).eval()


def build_random_sam2(config: Sam2Config | str, seed: int = 0, scale: float = 0.02) -> Sam2:
    """A SAM 2 model with seeded random weights, for benchmarks and tests: the default
    initialization plus N(0, scale) noise on every tensor, so zero-initialized ones take part."""
    return with_random_weights(lambda: build_sam2(config), seed, scale)


def from_official_keys(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """An official checkpoint's state dict in genfast's names (only the decoder MLPs differ)."""
    return {_TRANSFORMER_MLP.sub(lambda m: f"{m[1]}lin{int(m[2]) + 1}.", k): v for k, v in state_dict.items()}


def to_official_keys(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """genfast's state dict in the official checkpoints' names."""
    pattern = re.compile(r"^(sam_mask_decoder\.transformer\.layers\.\d+\.mlp\.)lin([12])\.")
    return {pattern.sub(lambda m: f"{m[1]}layers.{int(m[2]) - 1}.", k): v for k, v in state_dict.items()}


def config_from_state_dict(state_dict: dict[str, Tensor]) -> Sam2Config:
    """The official preset whose shapes the (official-layout) state dict has."""
    if _PATCH_KEY not in state_dict:
        raise UserError(
            f"not a SAM 2 checkpoint: it has no {_PATCH_KEY!r} tensor "
            "(expected an official sam2.1_hiera_*.pt / sam2_hiera_*.pt file)"
        )
    embed_dim = state_dict[_PATCH_KEY].shape[0]
    depth = 1 + max(int(m[1]) for k in state_dict if (m := re.match(r"image_encoder\.trunk\.blocks\.(\d+)\.", k)))
    # A stage's first block (after the first stage) widens the stream, with a projection.
    starts = [i for i in range(depth) if f"image_encoder.trunk.blocks.{i}.proj.weight" in state_dict]
    bounds = [0, *starts, depth]
    stages = tuple(b - a for a, b in pairwise(bounds))
    background = tuple(state_dict["image_encoder.trunk.pos_embed"].shape[2:])
    release = "2.1" if "no_obj_embed_spatial" in state_dict else "2.0"
    for preset in SAM2_PRESETS.values():
        if (preset.embed_dim, preset.stages, preset.window_pos_embed_bkg_spatial_size, preset.release) == (
            embed_dim,
            stages,
            background,
            release,
        ):
            return preset
    raise UserError(
        f"the checkpoint's Hiera trunk (width {embed_dim}, stages {stages}, SAM {release}) is none of the official "
        "SAM 2 models; build it from its config (genfast.sam.sam2.config.Sam2Config) instead"
    )


def sam2_from_state_dict(state_dict: dict[str, Tensor], config: Sam2Config, source: str) -> Sam2:
    """A model filled with an official-layout state dict (no time spent drawing random weights)."""
    with torch.device("meta"):
        model = Sam2(config)
    try:
        model.load_state_dict(from_official_keys(state_dict), strict=True, assign=True)
    except RuntimeError as e:
        detail = str(e).split("\n", 1)[-1].strip()
        raise UserError(f"SAM 2 weights {source} do not match the {config.name} architecture: {detail[:800]}") from e
    # Buffers that are not in the checkpoint (none today) would stay on the meta device.
    return model.eval()


def load_sam2_checkpoint(path: str | Path, config: Sam2Config | None = None) -> Sam2:
    """The SAM 2 model at `path`: an official .pt file, or a folder (or its model.safetensors) in
    Hugging Face's transformers layout. On the CPU, in the file's dtype, in eval mode."""
    path = Path(path).expanduser()
    if path.is_dir() or path.suffix == ".safetensors":
        return _load_transformers_layout(path.parent if path.is_file() else path, config)
    hint = "download an official sam2.1_hiera_*.pt (`genfast pull sam2.1-hiera-tiny`) or pass the right path"
    return sam2_from_checkpoint(read_checkpoint_file(path, "SAM 2", hint), path, config)


def is_sam2_checkpoint(loaded: object) -> bool:
    """Whether what a checkpoint file held is an official SAM 2 checkpoint ({"model": state dict})."""
    return isinstance(loaded, dict) and is_state_dict(loaded.get("model"))


def sam2_from_checkpoint(loaded: object, path: Path, config: Sam2Config | None = None) -> Sam2:
    """The model in what an official checkpoint file at `path` held."""
    state_dict = loaded.get("model") if isinstance(loaded, dict) and "model" in loaded else loaded
    if not is_state_dict(state_dict):
        raise UserError(
            f"{str(path)!r} is not a SAM 2 checkpoint: expected {{'model': state dict}} as the official files hold"
        )
    found = config_from_state_dict(state_dict) if config is None or config.name in SAM2_PRESETS else config
    if config is not None and not found.same_shapes(config):
        raise UserError(f"SAM 2 checkpoint {str(path)!r} holds {found.name}, not {config.name}")
    return sam2_from_state_dict(state_dict, found, repr(str(path)))


def _load_transformers_layout(folder: Path, config: Sam2Config | None) -> Sam2:
    config_path, weights = folder / "config.json", sorted(folder.glob("*.safetensors"))
    if not config_path.is_file() or not weights:
        raise UserError(
            f"{str(folder)!r} is not a SAM 2 model folder: it needs config.json and model.safetensors "
            "(Hugging Face's facebook/sam2.1-hiera-* layout)"
        )
    from safetensors.torch import load_file

    from genfast.sam.sam2.hf_layout import config_from_hf, official_state_dict_from_hf

    try:
        hf_config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {str(config_path)!r}: {e}") from e
    config = config or config_from_hf(hf_config)
    hf_state_dict: dict[str, Tensor] = {}
    for file in weights:
        hf_state_dict.update(load_file(file))
    state_dict = official_state_dict_from_hf(hf_state_dict, config)
    return sam2_from_state_dict(state_dict, config, repr(str(folder)))


def load_sam2(spec: str, config: Sam2Config | None = None) -> Sam2:
    """The model a name ('sam2.1-hiera-tiny', from the cache `genfast pull` fills), a checkpoint
    file or a transformers-layout folder names. A named download must have that model's shapes."""
    from genfast.storage.hub import resolve_sam2_checkpoint, sam2_model_name

    name = sam2_model_name(spec)
    model = load_sam2_checkpoint(resolve_sam2_checkpoint(spec), config or (sam2_preset(name) if name else None))
    return model
