"""Meta's official `sam2` package, imported without torchvision, and built from a Sam2Config: the
reference the tests check genfast's SAM 2 against and the baseline `genfast bench sam` times.

The package imports torchvision for three image transforms and two box operations. PyPI's
torchvision does not import with genfast's torch, so stand-ins take their place: the transforms
as small TorchScript-able modules (sam2 scripts them) computing what torchvision computes on a
tensor (bilinear resize with antialiasing, normalization, HWC uint8 -> CHW float), the box
operations as genfast's own (tested against a plain reference in tests/sam).
Install it with `SAM2_BUILD_CUDA=0 pip install --no-deps --no-build-isolation sam2` plus
hydra-core, iopath and tqdm (its other dependency, torchvision, is the one stubbed here).
"""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.sam.sam2.config import Sam2Config

_STUBBED = ("torchvision", "torchvision.transforms", "torchvision.ops", "torchvision.ops.boxes")


class Resize(nn.Module):
    """torchvision.transforms.Resize of a CHW tensor to a fixed size: bilinear, antialiased."""

    def __init__(self, size: tuple[int, int]) -> None:
        super().__init__()
        self.size = [int(size[0]), int(size[1])]

    def forward(self, x: Tensor) -> Tensor:
        return F.interpolate(x[None], size=self.size, mode="bilinear", align_corners=False, antialias=True)[0]


class Normalize(nn.Module):
    def __init__(self, mean: list[float], std: list[float]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean)[:, None, None])
        self.register_buffer("std", torch.tensor(std)[:, None, None])

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std


class ToTensor:
    """HWC uint8 (numpy or PIL) -> CHW float in [0, 1]."""

    def __call__(self, image: object) -> Tensor:
        array = np.asarray(image)
        tensor = torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1)
        return tensor.float().div(255) if array.dtype == np.uint8 else tensor.float()


def is_installed() -> bool:
    return importlib.util.find_spec("sam2") is not None


def import_sam2() -> types.ModuleType:
    """The sam2 package with torchvision stubbed (only the first import uses the stubs)."""
    if "sam2.sam2_image_predictor" in sys.modules:
        return sys.modules["sam2"]
    from genfast.sam import masks
    from genfast.sam.original import stubbed_modules

    with stubbed_modules(_STUBBED) as modules:
        transforms = modules["torchvision.transforms"]
        transforms.Resize, transforms.Normalize, transforms.ToTensor = Resize, Normalize, ToTensor
        boxes = modules["torchvision.ops.boxes"]
        boxes.batched_nms, boxes.box_area = masks.batched_nms, masks.box_area
        for name in (
            "sam2.modeling.sam2_base",
            "sam2.sam2_image_predictor",
            "sam2.sam2_video_predictor",
            "sam2.automatic_mask_generator",
        ):
            importlib.import_module(name)
        return sys.modules["sam2"]


def build_official_sam2(config: Sam2Config, video: bool = False) -> nn.Module:
    """The official model with `config`'s architecture, freshly initialized, in eval mode: a
    SAM2Base (what the image predictor and automatic generator take) or, with `video`, a
    SAM2VideoPredictor set up as the package's build_sam2_video_predictor sets it up.

    Built from the modules directly, as the package's Hydra configs would build them (they
    hard-code the official sizes)."""
    import_sam2()
    from sam2.modeling.backbones.hieradet import Hiera
    from sam2.modeling.backbones.image_encoder import FpnNeck, ImageEncoder
    from sam2.modeling.memory_attention import MemoryAttention, MemoryAttentionLayer
    from sam2.modeling.memory_encoder import CXBlock, Fuser, MaskDownSampler, MemoryEncoder
    from sam2.modeling.position_encoding import PositionEmbeddingSine
    from sam2.modeling.sam.transformer import RoPEAttention
    from sam2.modeling.sam2_base import SAM2Base
    from sam2.sam2_video_predictor import SAM2VideoPredictor

    d, grid = config.d_model, config.image_embedding_size
    trunk = Hiera(
        embed_dim=config.embed_dim,
        num_heads=config.num_heads,
        stages=config.stages,
        global_att_blocks=config.global_att_blocks,
        window_pos_embed_bkg_spatial_size=config.window_pos_embed_bkg_spatial_size,
        window_spec=config.window_spec,
    )
    neck = FpnNeck(
        position_encoding=PositionEmbeddingSine(num_pos_feats=d, normalize=True, temperature=10000),
        d_model=d,
        backbone_channel_list=list(config.channel_list),
        fpn_top_down_levels=list(config.fpn_top_down_levels),
        fpn_interp_model="nearest",
    )

    def rope(**kwargs: object) -> RoPEAttention:
        return RoPEAttention(
            rope_theta=10000.0, feat_sizes=(grid, grid), embedding_dim=d, num_heads=1, downsample_rate=1, **kwargs
        )

    layer = MemoryAttentionLayer(
        activation="relu",
        cross_attention=rope(rope_k_repeat=True, kv_in_dim=config.mem_dim, dropout=0.1),
        d_model=d,
        dim_feedforward=config.memory_attention_ffn_dim,
        dropout=0.1,
        pos_enc_at_attn=False,
        pos_enc_at_cross_attn_keys=True,
        pos_enc_at_cross_attn_queries=False,
        self_attention=rope(dropout=0.1),
    )
    memory_attention = MemoryAttention(
        d_model=d, pos_enc_at_input=True, layer=layer, num_layers=config.memory_attention_layers
    )
    memory_encoder = MemoryEncoder(
        out_dim=config.mem_dim,
        position_encoding=PositionEmbeddingSine(num_pos_feats=config.mem_dim, normalize=True, temperature=10000),
        mask_downsampler=MaskDownSampler(kernel_size=3, stride=2, padding=1, embed_dim=d),
        fuser=Fuser(
            CXBlock(dim=d, kernel_size=7, padding=3, layer_scale_init_value=1e-6, use_dwconv=True), num_layers=2
        ),
        in_dim=d,
    )
    release_2_1 = config.release == "2.1"
    kwargs = dict(
        image_encoder=ImageEncoder(trunk=trunk, neck=neck, scalp=1),
        memory_attention=memory_attention,
        memory_encoder=memory_encoder,
        num_maskmem=config.num_maskmem,
        image_size=config.image_size,
        sigmoid_scale_for_mem_enc=20.0,
        sigmoid_bias_for_mem_enc=-10.0,
        use_mask_input_as_output_without_sam=True,
        directly_add_no_mem_embed=True,
        no_obj_embed_spatial=release_2_1,
        use_high_res_features_in_sam=True,
        multimask_output_in_sam=True,
        iou_prediction_use_sigmoid=True,
        use_obj_ptrs_in_encoder=True,
        max_obj_ptrs_in_encoder=config.max_obj_ptrs_in_encoder,
        add_tpos_enc_to_obj_ptrs=release_2_1,
        proj_tpos_enc_in_obj_ptrs=release_2_1,
        use_signed_tpos_enc_to_obj_ptrs=release_2_1,
        only_obj_ptrs_in_the_past_for_eval=True,
        pred_obj_scores=True,
        pred_obj_scores_mlp=True,
        fixed_no_obj_ptr=True,
        multimask_output_for_tracking=True,
        use_multimask_token_for_obj_ptr=True,
        multimask_min_pt_num=0,
        multimask_max_pt_num=1,
        use_mlp_for_obj_ptr_proj=True,
        # build_sam2's post-processing overrides
        sam_mask_decoder_extra_args=dict(
            dynamic_multimask_via_stability=True,
            dynamic_multimask_stability_delta=0.05,
            dynamic_multimask_stability_thresh=0.98,
        ),
    )
    if video:
        # build_sam2_video_predictor's further overrides; its hole filling needs the CUDA
        # extension, without which the package skips it with a warning (fill_hole_area=0 here).
        model = SAM2VideoPredictor(binarize_mask_from_pts_for_mem_enc=True, fill_hole_area=0, **kwargs)
    else:
        model = SAM2Base(**kwargs)
    return model.eval()
