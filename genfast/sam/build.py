"""Build SAM models from a config, and load the official checkpoints (`sam_vit_b_01ec64.pth`,
`sam_vit_l_0b3195.pth`, `sam_vit_h_4b8939.pth`: plain state dicts).

The architecture is read from the tensor shapes, never from the file name. Shapes fix every
field but the decoder's head count, which is 8 in all official models (pass a config to load
anything else).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

from genfast.errors import UserError
from genfast.sam.config import SAM_PRESETS, SamConfig, sam_preset
from genfast.sam.modeling import Sam

_PATCH_KEY = "image_encoder.patch_embed.proj.weight"
M = TypeVar("M", bound=torch.nn.Module)


def build_sam(config: SamConfig | str) -> Sam:
    """A SAM model with freshly initialized weights (a preset name or a config), in eval mode."""
    if isinstance(config, str):
        config = sam_preset(config)
    return Sam(config).eval()


def build_random_sam(config: SamConfig | str, seed: int = 0, scale: float = 0.02) -> Sam:
    """A SAM model with seeded random weights, for benchmarks (speed does not depend on weight
    values) and tests: the default initialization plus N(0, scale) noise on every tensor, so the
    zero-initialized ones (positions, relative positions, biases) take part as in a trained model."""
    return with_random_weights(lambda: build_sam(config), seed, scale)


def with_random_weights(build: Callable[[], M], seed: int, scale: float) -> M:
    """`build()`'s model, built and then perturbed by N(0, scale) noise on every tensor, drawn from
    its own seeded generator (the caller's random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.add_(torch.randn_like(tensor) * scale)
    return model


def _count(state_dict: dict[str, Tensor], prefix: str) -> int:
    """How many consecutive numbered children `prefix.{i}.` the state dict holds."""
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    found = {int(m.group(1)) for key in state_dict if (m := pattern.match(key))}
    return max(found) + 1 if found else 0


def config_from_state_dict(state_dict: dict[str, Tensor], decoder_num_heads: int = 8) -> SamConfig:
    """The SamConfig whose shapes the state dict has; the named preset when it is one of them.

    Global-attention blocks are told apart from windowed ones by the length of their relative
    position tables (2 * grid - 1 vs 2 * window - 1), so a window as large as the grid is
    indistinguishable from global attention: such configs need to be passed explicitly.
    """
    if _PATCH_KEY not in state_dict:
        raise UserError(
            f"not a Segment Anything checkpoint: it has no {_PATCH_KEY!r} tensor "
            "(expected a state dict like the official sam_vit_*.pth files)"
        )
    try:
        dim, _, patch, _ = state_dict[_PATCH_KEY].shape
        grid = state_dict["image_encoder.pos_embed"].shape[1]
        depth = _count(state_dict, "image_encoder.blocks")
        rel_rows = [state_dict[f"image_encoder.blocks.{i}.attn.rel_pos_h"].shape[0] for i in range(depth)]
        head_dim = state_dict["image_encoder.blocks.0.attn.rel_pos_h"].shape[1]
        global_idx = tuple(i for i, rows in enumerate(rel_rows) if rows == 2 * grid - 1)
        windowed = [rows for rows in rel_rows if rows != 2 * grid - 1]
        prompt_dim = state_dict["image_encoder.neck.0.weight"].shape[0]
        decoder = "mask_decoder.transformer"
        config = SamConfig(
            encoder_embed_dim=dim,
            encoder_depth=depth,
            encoder_num_heads=dim // head_dim,
            encoder_global_attn_indexes=global_idx,
            image_size=grid * patch,
            patch_size=patch,
            window_size=(windowed[0] + 1) // 2 if windowed else 14,
            mlp_ratio=state_dict["image_encoder.blocks.0.mlp.lin1.weight"].shape[0] / dim,
            prompt_embed_dim=prompt_dim,
            mask_in_chans=state_dict["prompt_encoder.mask_downscaling.3.weight"].shape[0],
            decoder_depth=_count(state_dict, f"{decoder}.layers"),
            decoder_num_heads=decoder_num_heads,
            decoder_mlp_dim=state_dict[f"{decoder}.layers.0.mlp.lin1.weight"].shape[0],
            decoder_attn_downsample=prompt_dim
            // state_dict[f"{decoder}.final_attn_token_to_image.q_proj.weight"].shape[0],
            iou_head_depth=_count(state_dict, "mask_decoder.iou_prediction_head.layers"),
            iou_head_hidden_dim=state_dict["mask_decoder.iou_prediction_head.layers.0.weight"].shape[0],
            num_multimask_outputs=state_dict["mask_decoder.mask_tokens.weight"].shape[0] - 1,
        )
    except (KeyError, ValueError, ZeroDivisionError) as e:
        raise UserError(f"not a complete Segment Anything checkpoint: cannot read its architecture ({e!r})") from e
    for preset in SAM_PRESETS.values():
        if config.same_shapes(preset):
            return preset
    return config


def read_checkpoint_file(path: Path, kind: str, hint: str) -> object:
    """What a PyTorch checkpoint file holds, read safely (weights only: no code in the pickle
    runs). `kind` names the model in messages ("SAM"), `hint` says where to get a good file."""
    if not path.is_file():
        raise UserError(f"{kind} checkpoint {str(path)!r} does not exist (or is not a file); {hint}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt zip, pickle with code, truncated file: all the user's to fix
        # torch's message for a pickle it will not run suggests weights_only=False (not advice to pass
        # on) around the one line that says what it met, e.g. "Unsupported operand 110"
        boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
        detail = [line for line in str(e).splitlines() if line.strip() and not line.startswith(boilerplate)]
        detail = detail or [type(e).__name__]
        raise UserError(
            f"cannot read {kind} checkpoint {str(path)!r}: not a state dict genfast can load without running code "
            f"from the file (truncated, corrupt, or another format): {detail[0][:300]}"
        ) from e


def is_state_dict(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(v, Tensor) for v in value.values())


def load_sam_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Read a SAM checkpoint file safely (weights only: no code in the pickle runs)."""
    path = Path(path)
    state_dict = read_checkpoint_file(
        path, "SAM", "download one of the official sam_vit_*.pth files or pass the right path"
    )
    if not is_state_dict(state_dict):
        raise UserError(
            f"{str(path)!r} is not a SAM checkpoint: expected a state dict of tensors, got {type(state_dict).__name__}"
        )
    return state_dict


def load_sam_checkpoint(path: str | Path, config: SamConfig | None = None) -> Sam:
    """The SAM model stored at `path` (architecture inferred from its shapes unless `config` is
    given), on the CPU in the checkpoint's dtype, in eval mode."""
    return sam_from_state_dict(load_sam_state_dict(path), str(path), config)


def sam_from_state_dict(state_dict: dict[str, Tensor], source: str, config: SamConfig | None = None) -> Sam:
    """A SAM model filled with a checkpoint's state dict (read from `source`, named in errors)."""
    if config is None:
        config = config_from_state_dict(state_dict)
    # Built on the meta device and filled by assignment: no time spent drawing random weights.
    with torch.device("meta"):
        model = Sam(config)
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as e:
        detail = str(e).split("\n", 1)[-1].strip()
        raise UserError(
            f"SAM checkpoint {source!r} does not match the {config.name} architecture: {detail[:800]}"
        ) from e
    model.reset_pixel_stats()
    return model.eval()
