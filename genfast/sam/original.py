"""The original `segment-anything` package (PyPI), as the baseline of `genfast bench sam` and the
reference of the tests.

It imports torchvision at package import, for PIL resizing and NMS that its model code does not
use, and PyPI's torchvision does not import with this torch. So the import runs with small stub
modules in sys.modules; they are removed right after, so nothing else in the process (e.g.
transformers probing for torchvision) ever sees them. Callers needing the stubbed functions pass
their own (`stubs`).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial

import torch

from genfast.sam.config import SamConfig

_STUBBED = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.ops",
    "torchvision.ops.boxes",
)


def _unavailable(name: str) -> Callable:
    def stub(*args, **kwargs):
        raise NotImplementedError(
            f"torchvision.{name} is stubbed out: genfast imports segment-anything without torchvision"
        )

    return stub


def is_installed() -> bool:
    return importlib.util.find_spec("segment_anything") is not None


@contextmanager
def stubbed_modules(names: Sequence[str]) -> Iterator[dict[str, types.ModuleType]]:
    """Empty modules under `names` in sys.modules (given to the caller to fill in) while a package
    that imports them is imported; what was there before is put back afterwards."""
    saved = {name: sys.modules.get(name) for name in names}
    try:
        stubs = {}
        for name in names:
            stubs[name] = sys.modules[name] = types.ModuleType(name)
            stubs[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
        yield stubs
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def import_segment_anything(stubs: Mapping[str, Callable] | None = None) -> types.ModuleType:
    """The segment_anything package. `stubs` maps "module.function" (e.g. "ops.boxes.batched_nms")
    to implementations of the torchvision functions it imports; the rest raise when called. Only
    the first import uses them."""
    if "segment_anything" in sys.modules:
        return sys.modules["segment_anything"]
    with stubbed_modules(_STUBBED) as modules:
        functions = {
            "transforms.functional.resize": None,
            "transforms.functional.to_pil_image": None,
            "ops.boxes.batched_nms": None,
            "ops.boxes.box_area": None,
            **(stubs or {}),
        }
        for path, fn in functions.items():
            module_name, _, attr = f"torchvision.{path}".rpartition(".")
            setattr(modules[module_name], attr, fn or _unavailable(path))
        return importlib.import_module("segment_anything")


def build_original_sam(config: SamConfig) -> torch.nn.Module:
    """The original package's Sam with the architecture `config` describes (its `_build_sam`
    hard-codes the official sizes, so the parts are built directly), in eval mode."""
    import_segment_anything()
    from segment_anything.modeling import ImageEncoderViT, MaskDecoder, PromptEncoder, Sam, TwoWayTransformer

    grid = config.image_embedding_size
    sam = Sam(
        image_encoder=ImageEncoderViT(
            img_size=config.image_size,
            patch_size=config.patch_size,
            embed_dim=config.encoder_embed_dim,
            depth=config.encoder_depth,
            num_heads=config.encoder_num_heads,
            mlp_ratio=config.mlp_ratio,
            out_chans=config.prompt_embed_dim,
            qkv_bias=True,
            norm_layer=partial(torch.nn.LayerNorm, eps=1e-6),
            use_rel_pos=True,
            window_size=config.window_size,
            global_attn_indexes=config.encoder_global_attn_indexes,
        ),
        prompt_encoder=PromptEncoder(
            embed_dim=config.prompt_embed_dim,
            image_embedding_size=(grid, grid),
            input_image_size=(config.image_size, config.image_size),
            mask_in_chans=config.mask_in_chans,
        ),
        mask_decoder=MaskDecoder(
            transformer_dim=config.prompt_embed_dim,
            transformer=TwoWayTransformer(
                depth=config.decoder_depth,
                embedding_dim=config.prompt_embed_dim,
                num_heads=config.decoder_num_heads,
                mlp_dim=config.decoder_mlp_dim,
                attention_downsample_rate=config.decoder_attn_downsample,
            ),
            num_multimask_outputs=config.num_multimask_outputs,
            iou_head_depth=config.iou_head_depth,
            iou_head_hidden_dim=config.iou_head_hidden_dim,
        ),
    )
    return sam.eval()


def use_genfast_resize(predictor: object) -> None:
    """Resize numpy images in an original SamPredictor with genfast's resize (the original's goes
    through PIL by way of torchvision, stubbed out here), so both encode identical pixels."""
    from genfast.sam.transforms import ResizeLongestSide

    predictor.transform.apply_image = ResizeLongestSide(predictor.transform.target_length).apply_image


def nms_functions() -> tuple[dict[str, Callable], str]:
    """The torchvision functions the original automatic mask generator calls (`stubs` for
    import_segment_anything), and whose they are: torchvision's where it imports, else genfast's
    (the same semantics, tested against a plain reference)."""
    try:
        from torchvision.ops import boxes
    except (ImportError, RuntimeError):  # not installed, or built for another torch
        from genfast.sam import masks

        return {"ops.boxes.batched_nms": masks.batched_nms, "ops.boxes.box_area": masks.box_area}, "genfast's"
    return {"ops.boxes.batched_nms": boxes.batched_nms, "ops.boxes.box_area": boxes.box_area}, "torchvision's"
