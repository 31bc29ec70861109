"""SAM 2 checkpoints in the transformers layout (the `facebook/sam2-hiera-*` and
`facebook/sam2.1-hiera-*` repos' config.json and model.safetensors) read as the official layout.

Those repos hold a `Sam2VideoModel` (model_type "sam2_video"): the whole tracker, which is what
genfast's SAM 2 loads. transformers' image-only `Sam2Model` ("sam2") lacks the memory modules and
object pointers, so its checkpoints are refused. The two layouts hold the same tensors with the
same shapes; only the names differ, except that the four point embeddings are one table in
transformers and the random-Fourier positional matrix is stored twice there (once for prompts,
once for the image-wide encoding), where the official model has one.

Only the official architecture is accepted: every config setting genfast's model fixes must have
the official value, and the sizes it does not fix are read into a Sam2Config.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from genfast.errors import UserError
from genfast.sam.sam2.config import SAM2_PRESETS, Sam2Config

# transformers' defaults for each config section: its config.json omits fields left at them.
_TOP_DEFAULTS: dict[str, Any] = {
    "num_maskmem": 7,
    "image_size": 1024,
    "sigmoid_scale_for_mem_enc": 20.0,
    "sigmoid_bias_for_mem_enc": -10.0,
    "enable_occlusion_spatial_embedding": True,
    "multimask_output_in_sam": True,
    "multimask_min_pt_num": 0,
    "multimask_max_pt_num": 1,
    "multimask_output_for_tracking": True,
    "max_object_pointers_in_encoder": 16,
    "max_cond_frame_num": -1,
    "enable_temporal_pos_encoding_for_object_pointers": True,
    "memory_attention_hidden_size": 256,
    "memory_attention_num_layers": 4,
    "memory_attention_num_attention_heads": 1,
    "memory_attention_downsample_rate": 1,
    "memory_attention_feed_forward_hidden_size": 2048,
    "memory_attention_feed_forward_hidden_act": "relu",
    "memory_attention_rope_feat_sizes": [64, 64],
    "memory_encoder_hidden_size": 256,
    "memory_encoder_output_channels": 64,
    "mask_downsampler_embed_dim": 256,
    "mask_downsampler_kernel_size": 3,
    "mask_downsampler_stride": 2,
    "mask_downsampler_padding": 1,
    "mask_downsampler_total_stride": 16,
    "mask_downsampler_hidden_act": "gelu",
    "memory_fuser_num_layers": 2,
    "memory_fuser_embed_dim": 256,
    "memory_fuser_intermediate_dim": 1024,
    "memory_fuser_kernel_size": 7,
    "memory_fuser_padding": 3,
    "memory_fuser_hidden_act": "gelu",
}
_VISION_DEFAULTS: dict[str, Any] = {
    "backbone_channel_list": [768, 384, 192, 96],
    "backbone_feature_sizes": [[256, 256], [128, 128], [64, 64]],
    "fpn_hidden_size": 256,
    "fpn_kernel_size": 1,
    "fpn_stride": 1,
    "fpn_padding": 0,
    "fpn_top_down_levels": [2, 3],
    "num_feature_levels": 3,
}
_HIERA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 96,
    "num_channels": 3,
    "patch_kernel_size": [7, 7],
    "patch_stride": [4, 4],
    "patch_padding": [3, 3],
    "query_stride": [2, 2],
    "window_positional_embedding_background_size": [7, 7],
    "num_query_pool_stages": 3,
    "blocks_per_stage": [1, 2, 7, 2],
    "embed_dim_per_stage": [96, 192, 384, 768],
    "num_attention_heads_per_stage": [1, 2, 4, 8],
    "window_size_per_stage": [8, 4, 14, 7],
    "global_attention_blocks": [5, 7, 9],
    "mlp_ratio": 4.0,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-6,
}
_PROMPT_DEFAULTS: dict[str, Any] = {
    "hidden_size": 256,
    "image_size": 1024,
    "patch_size": 16,
    "mask_input_channels": 16,
    "num_point_embeddings": 4,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-6,
}
_DECODER_DEFAULTS: dict[str, Any] = {
    "hidden_size": 256,
    "hidden_act": "gelu",
    "mlp_dim": 2048,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "attention_downsample_rate": 2,
    "num_multimask_outputs": 3,
    "iou_head_depth": 3,
    "iou_head_hidden_dim": 256,
    "dynamic_multimask_via_stability": True,
    "dynamic_multimask_stability_delta": 0.05,
    "dynamic_multimask_stability_thresh": 0.98,
}

_DEFAULTS: dict[str, dict[str, Any]] = {
    "": _TOP_DEFAULTS,
    "vision_config": _VISION_DEFAULTS,
    "vision_config.backbone_config": _HIERA_DEFAULTS,
    "prompt_encoder_config": _PROMPT_DEFAULTS,
    "mask_decoder_config": _DECODER_DEFAULTS,
}
# The settings the official model (and so genfast's) hard-codes, at their transformers defaults,
# which are the official values. Settings that only act in training (dropouts) or at
# initialization (scales of random inits) are not read.
_FIXED: dict[str, tuple[str, ...]] = {
    "": (
        "sigmoid_scale_for_mem_enc",
        "sigmoid_bias_for_mem_enc",
        "multimask_output_in_sam",
        "multimask_min_pt_num",
        "multimask_max_pt_num",
        "multimask_output_for_tracking",
        "max_cond_frame_num",
        "memory_attention_num_attention_heads",
        "memory_attention_downsample_rate",
        "memory_attention_feed_forward_hidden_act",
        "memory_encoder_output_channels",
        "mask_downsampler_kernel_size",
        "mask_downsampler_stride",
        "mask_downsampler_padding",
        "mask_downsampler_total_stride",
        "mask_downsampler_hidden_act",
        "memory_fuser_num_layers",
        "memory_fuser_kernel_size",
        "memory_fuser_padding",
        "memory_fuser_hidden_act",
    ),
    "vision_config": ("fpn_kernel_size", "fpn_stride", "fpn_padding", "num_feature_levels"),
    "vision_config.backbone_config": (
        "num_channels",
        "patch_kernel_size",
        "patch_stride",
        "patch_padding",
        "query_stride",
        "num_query_pool_stages",
        "mlp_ratio",
        "hidden_act",
        "layer_norm_eps",
    ),
    "prompt_encoder_config": (
        "patch_size",
        "mask_input_channels",
        "num_point_embeddings",
        "hidden_act",
        "layer_norm_eps",
    ),
    "mask_decoder_config": tuple(field for field in _DECODER_DEFAULTS if field != "hidden_size"),
}
_ROPE_THETA = 10000.0
# Layers of the memory encoder's mask downsampler: log2(total stride 16) / log2(stride 2).
_MASK_DOWNSAMPLER_LAYERS = 4


def _same(value: Any, expected: Any) -> bool:
    """Config values compared as written in JSON: [7, 7] equals (7, 7), and an int given for a
    pair (transformers accepts both) equals the pair."""
    if isinstance(expected, (list, tuple)):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value] * len(expected)
        return isinstance(value, (list, tuple)) and len(value) == len(expected) and all(map(_same, value, expected))
    if isinstance(expected, float) and not isinstance(value, bool) and isinstance(value, (int, float)):
        return math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-12)
    return type(value) is type(expected) and value == expected


def _square(value: Any) -> int | None:
    """A side from an int or an [h, w] pair; None when the pair is not square."""
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        return int(value[0])
    return None


def config_from_hf(config_json: Mapping[str, Any]) -> Sam2Config:
    """The Sam2Config of a transformers SAM 2 checkpoint's config.json (a Sam2VideoConfig).

    Raises UserError for another model or for settings genfast's SAM 2 does not implement,
    naming each. The result is the official preset when the sizes are one's."""
    model_type = config_json.get("model_type")
    if model_type == "sam2":
        raise UserError(
            "this is transformers' image-only SAM 2 checkpoint (Sam2Model): it lacks the video tracker's "
            "weights (memory attention and encoder, object pointers) that genfast's SAM 2 loads; use the full "
            "checkpoint (model_type 'sam2_video', as the facebook/sam2.1-hiera-* repos publish) or the official "
            "sam2.1_hiera_*.pt"
        )
    if model_type != "sam2_video":
        raise UserError(
            f"not a SAM 2 checkpoint: model_type {model_type!r} (architectures {config_json.get('architectures')}); "
            "genfast reads transformers' SAM 2 as model_type 'sam2_video'"
        )
    vision_json = config_json.get("vision_config") or {}
    sections = {
        "": config_json,
        "vision_config": vision_json,
        "vision_config.backbone_config": vision_json.get("backbone_config") or {},
        "prompt_encoder_config": config_json.get("prompt_encoder_config") or {},
        "mask_decoder_config": config_json.get("mask_decoder_config") or {},
    }

    def get(section: str, field: str) -> Any:
        return sections[section].get(field, _DEFAULTS[section][field])

    def where(section: str, field: str) -> str:
        return f"{section}.{field}" if section else field

    problems = []
    for section, field in ((section, field) for section, fields in _FIXED.items() for field in fields):
        value, expected = get(section, field), _DEFAULTS[section][field]
        if not _same(value, expected):
            note = ""
            if field == "memory_encoder_output_channels":
                note = " (transformers' memory attention reads 64-channel memories whatever it says)"
            problems.append(f"{where(section, field)} is {value!r}, where SAM 2 has {expected!r}{note}")

    rope = config_json.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config_json.get("memory_attention_rope_theta", _ROPE_THETA))
    if not _same(theta, _ROPE_THETA) or rope.get("rope_type", "axial") != "axial":
        problems.append(f"memory attention RoPE {rope or theta!r}, where SAM 2 has axial RoPE with theta 10000")

    occlusion = get("", "enable_occlusion_spatial_embedding")
    temporal = get("", "enable_temporal_pos_encoding_for_object_pointers")
    if occlusion != temporal:
        problems.append(
            f"enable_occlusion_spatial_embedding is {occlusion!r} but enable_temporal_pos_encoding_for_object_"
            f"pointers is {temporal!r}: SAM 2.1 has both, 2.0 neither"
        )

    # The Hiera trunk: four stages, each doubling the width and the heads of the one before.
    hiera = "vision_config.backbone_config"
    embed_dim = get(hiera, "hidden_size")
    dims = list(get(hiera, "embed_dim_per_stage"))
    heads = list(get(hiera, "num_attention_heads_per_stage"))
    stages = list(get(hiera, "blocks_per_stage"))
    windows = list(get(hiera, "window_size_per_stage"))
    if not len(stages) == len(dims) == len(heads) == len(windows) == 4:
        problems.append(
            f"{hiera} has {len(stages)} stages ({len(dims)} widths, {len(heads)} head counts, {len(windows)} "
            "window sizes), where SAM 2's Hiera has 4"
        )
    elif dims != [embed_dim * 2**i for i in range(4)]:
        problems.append(f"{hiera}.embed_dim_per_stage is {dims}: not hidden_size {embed_dim} doubling per stage")
    if heads and heads != [heads[0] * 2**i for i in range(len(heads))]:
        problems.append(f"{hiera}.num_attention_heads_per_stage is {heads}: the heads do not double per stage")
    bkg = get(hiera, "window_positional_embedding_background_size")

    d_model = get("vision_config", "fpn_hidden_size")
    channels = list(get("vision_config", "backbone_channel_list"))
    if channels != dims[::-1]:
        problems.append(f"vision_config.backbone_channel_list is {channels}, not the stage widths {dims} reversed")
    for section, field in (
        ("prompt_encoder_config", "hidden_size"),
        ("mask_decoder_config", "hidden_size"),
        ("", "memory_attention_hidden_size"),
        ("", "memory_encoder_hidden_size"),
        ("", "mask_downsampler_embed_dim"),
        ("", "memory_fuser_embed_dim"),
    ):
        if get(section, field) != d_model:
            problems.append(f"{where(section, field)} is {get(section, field)}, not fpn_hidden_size {d_model}")
    if d_model == get("", "memory_encoder_output_channels"):
        problems.append(
            f"fpn_hidden_size equals memory_encoder_output_channels ({d_model}): transformers then projects the "
            "memories all the same, where the official model has no projection"
        )
    if get("", "memory_fuser_intermediate_dim") != 4 * d_model:
        problems.append(
            f"memory_fuser_intermediate_dim is {get('', 'memory_fuser_intermediate_dim')}, not 4 x {d_model}"
        )

    image_size = _square(get("prompt_encoder_config", "image_size"))
    top_size = _square(get("", "image_size"))
    hiera_size = _square(sections[hiera].get("image_size", image_size))
    if image_size is None or top_size != image_size or hiera_size != image_size:
        problems.append(
            f"image sizes disagree or are not square: prompt encoder {get('prompt_encoder_config', 'image_size')}, "
            f"model {get('', 'image_size')}, backbone {sections[hiera].get('image_size')}"
        )
    elif image_size % 32 == 0:
        # transformers reshapes the FPN levels and places its RoPE with these sizes as given.
        feature_sizes = [[image_size // s] * 2 for s in (4, 8, 16)]
        if not _same(get("vision_config", "backbone_feature_sizes"), feature_sizes):
            problems.append(
                f"vision_config.backbone_feature_sizes is {get('vision_config', 'backbone_feature_sizes')}, "
                f"where a {image_size}-pixel input gives {feature_sizes}"
            )
        grid = [image_size // 16] * 2
        if not _same(get("", "memory_attention_rope_feat_sizes"), grid):
            problems.append(
                f"memory_attention_rope_feat_sizes is {get('', 'memory_attention_rope_feat_sizes')}, "
                f"where a {image_size}-pixel input gives {grid}"
            )

    if problems:
        raise UserError("unsupported SAM 2 checkpoint config: " + "; ".join(problems))

    config = Sam2Config(
        embed_dim=embed_dim,
        num_heads=heads[0],
        stages=tuple(stages),
        global_att_blocks=tuple(get(hiera, "global_attention_blocks")),
        window_spec=tuple(windows),
        window_pos_embed_bkg_spatial_size=tuple(bkg) if isinstance(bkg, (list, tuple)) else (bkg, bkg),
        d_model=d_model,
        fpn_top_down_levels=tuple(get("vision_config", "fpn_top_down_levels")),
        image_size=image_size,
        mem_dim=get("", "memory_encoder_output_channels"),
        num_maskmem=get("", "num_maskmem"),
        memory_attention_layers=get("", "memory_attention_num_layers"),
        memory_attention_ffn_dim=get("", "memory_attention_feed_forward_hidden_size"),
        max_obj_ptrs_in_encoder=get("", "max_object_pointers_in_encoder"),
        release="2.1" if occlusion else "2.0",
    )
    return next((preset for preset in SAM2_PRESETS.values() if config.same_shapes(preset)), config)


def official_shapes(config: Sam2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the official checkpoint of `config` (its state-dict keys) and its shape."""
    d, mem, e = config.d_model, config.mem_dim, config.embed_dim
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, out_features: int, in_features: int) -> None:
        shapes[f"{name}.weight"] = (out_features, in_features)
        shapes[f"{name}.bias"] = (out_features,)

    def conv(name: str, out_channels: int, in_channels: int, kernel: int) -> None:
        shapes[f"{name}.weight"] = (out_channels, in_channels, kernel, kernel)
        shapes[f"{name}.bias"] = (out_channels,)

    def norm(name: str, features: int) -> None:
        shapes[f"{name}.weight"] = shapes[f"{name}.bias"] = (features,)

    def mlp(name: str, sizes: list[int]) -> None:
        for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
            linear(f"{name}.layers.{i}", n_out, n_in)

    def attention(name: str, dim: int, internal: int, kv_dim: int) -> None:
        linear(f"{name}.q_proj", internal, dim)
        linear(f"{name}.k_proj", internal, kv_dim)
        linear(f"{name}.v_proj", internal, kv_dim)
        linear(f"{name}.out_proj", dim, internal)

    shapes["maskmem_tpos_enc"] = (config.num_maskmem, 1, 1, mem)
    shapes["no_mem_embed"] = shapes["no_mem_pos_enc"] = (1, 1, d)
    shapes["no_obj_ptr"] = (1, d)
    if config.no_obj_embed_spatial:
        shapes["no_obj_embed_spatial"] = (1, mem)

    trunk = "image_encoder.trunk"
    shapes[f"{trunk}.pos_embed"] = (1, e, *config.window_pos_embed_bkg_spatial_size)
    shapes[f"{trunk}.pos_embed_window"] = (1, e, config.window_spec[0], config.window_spec[0])
    conv(f"{trunk}.patch_embed.proj", e, 3, 7)
    # A stage's first block widens (with a projection on its skip path) and pools.
    stage_starts = {sum(config.stages[:i]) for i in range(1, len(config.stages))}
    dim = e
    for i in range(config.depth):
        dim_out = 2 * dim if i in stage_starts else dim
        block = f"{trunk}.blocks.{i}"
        norm(f"{block}.norm1", dim)
        linear(f"{block}.attn.qkv", 3 * dim_out, dim)
        linear(f"{block}.attn.proj", dim_out, dim_out)
        norm(f"{block}.norm2", dim_out)
        mlp(f"{block}.mlp", [dim_out, 4 * dim_out, dim_out])
        if dim_out != dim:
            linear(f"{block}.proj", dim_out, dim)
        dim = dim_out
    for i, channels in enumerate(config.channel_list):
        conv(f"image_encoder.neck.convs.{i}.conv", d, channels, 1)

    shapes["mask_downsample.weight"] = (1, 1, 4, 4)
    shapes["mask_downsample.bias"] = (1,)
    for i in range(config.memory_attention_layers):
        layer = f"memory_attention.layers.{i}"
        attention(f"{layer}.self_attn", d, d, d)
        attention(f"{layer}.cross_attn_image", d, d, mem)
        linear(f"{layer}.linear1", config.memory_attention_ffn_dim, d)
        linear(f"{layer}.linear2", d, config.memory_attention_ffn_dim)
        for k in (1, 2, 3):
            norm(f"{layer}.norm{k}", d)
    norm("memory_attention.norm", d)

    channels = 1
    for i in range(_MASK_DOWNSAMPLER_LAYERS):
        conv(f"memory_encoder.mask_downsampler.encoder.{3 * i}", 4 * channels, channels, 3)
        norm(f"memory_encoder.mask_downsampler.encoder.{3 * i + 1}", 4 * channels)
        channels *= 4
    conv(f"memory_encoder.mask_downsampler.encoder.{3 * _MASK_DOWNSAMPLER_LAYERS}", d, channels, 1)
    conv("memory_encoder.pix_feat_proj", d, d, 1)
    for i in range(2):
        block = f"memory_encoder.fuser.layers.{i}"
        shapes[f"{block}.gamma"] = (d,)
        shapes[f"{block}.dwconv.weight"] = (d, 1, 7, 7)
        shapes[f"{block}.dwconv.bias"] = (d,)
        norm(f"{block}.norm", d)
        linear(f"{block}.pwconv1", 4 * d, d)
        linear(f"{block}.pwconv2", d, 4 * d)
    if mem != d:  # otherwise an identity
        conv("memory_encoder.out_proj", mem, d, 1)

    prompt = "sam_prompt_encoder"
    shapes[f"{prompt}.pe_layer.positional_encoding_gaussian_matrix"] = (2, d // 2)
    for i in range(4):
        shapes[f"{prompt}.point_embeddings.{i}.weight"] = (1, d)
    shapes[f"{prompt}.not_a_point_embed.weight"] = shapes[f"{prompt}.no_mask_embed.weight"] = (1, d)
    for index, out_channels, in_channels, kernel in ((0, 4, 1, 2), (3, 16, 4, 2), (6, d, 16, 1)):
        conv(f"{prompt}.mask_downscaling.{index}", out_channels, in_channels, kernel)
    norm(f"{prompt}.mask_downscaling.1", 4)
    norm(f"{prompt}.mask_downscaling.4", 16)

    decoder = "sam_mask_decoder"
    for i in range(2):
        layer = f"{decoder}.transformer.layers.{i}"
        attention(f"{layer}.self_attn", d, d, d)
        attention(f"{layer}.cross_attn_token_to_image", d, d // 2, d)
        attention(f"{layer}.cross_attn_image_to_token", d, d // 2, d)
        mlp(f"{layer}.mlp", [d, 2048, d])
        for k in (1, 2, 3, 4):
            norm(f"{layer}.norm{k}", d)
    attention(f"{decoder}.transformer.final_attn_token_to_image", d, d // 2, d)
    norm(f"{decoder}.transformer.norm_final_attn", d)
    shapes[f"{decoder}.iou_token.weight"] = shapes[f"{decoder}.obj_score_token.weight"] = (1, d)
    shapes[f"{decoder}.mask_tokens.weight"] = (4, d)
    shapes[f"{decoder}.output_upscaling.0.weight"] = (d, d // 4, 2, 2)
    shapes[f"{decoder}.output_upscaling.0.bias"] = (d // 4,)
    norm(f"{decoder}.output_upscaling.1", d // 4)
    shapes[f"{decoder}.output_upscaling.3.weight"] = (d // 4, d // 8, 2, 2)
    shapes[f"{decoder}.output_upscaling.3.bias"] = (d // 8,)
    conv(f"{decoder}.conv_s0", d // 8, d, 1)
    conv(f"{decoder}.conv_s1", d // 4, d, 1)
    for i in range(4):
        mlp(f"{decoder}.output_hypernetworks_mlps.{i}", [d, d, d, d // 8])
    mlp(f"{decoder}.iou_prediction_head", [d, 256, 256, 4])
    mlp(f"{decoder}.pred_obj_score_head", [d, d, d, 1])

    mlp("obj_ptr_proj", [d, d, d, d])
    if config.proj_tpos_enc_in_obj_ptrs:
        linear("obj_ptr_tpos_proj", mem, d)
    return shapes


# transformers key -> official key, by full-match rules (first match wins).
_Rule = tuple[re.Pattern[str], Callable[[re.Match[str]], str]]
_P = r"(?P<p>weight|bias)"


def _rename(pattern: str, template: str) -> _Rule:
    return re.compile(pattern), lambda m: m.expand(template)


def _indexed(pattern: str, prefix: str, index: Callable[[int], int], suffix: str = r".\g<p>") -> _Rule:
    """A key whose official index is computed from transformers' (group `i`)."""
    return re.compile(pattern), lambda m: f"{m.expand(prefix)}.{index(int(m['i']))}{m.expand(suffix)}"


def _mlp(pattern: str, prefix: str, depth: int) -> list[_Rule]:
    """transformers' feed-forward (proj_in, hidden `layers`, proj_out) is the official MLP's
    `layers` 0..depth-1."""
    return [
        _rename(pattern + r"\.proj_in\." + _P, prefix + r".layers.0.\g<p>"),
        _indexed(pattern + r"\.layers\.(?P<i>\d+)\." + _P, prefix + ".layers", lambda i: i + 1),
        _rename(pattern + r"\.proj_out\." + _P, prefix + f".layers.{depth - 1}" + r".\g<p>"),
    ]


def _attention(pattern: str, prefix: str) -> list[_Rule]:
    return [
        _rename(pattern + r"\.(?P<x>[qkv])_proj\." + _P, prefix + r".\g<x>_proj.\g<p>"),
        _rename(pattern + r"\.o_proj\." + _P, prefix + r".out_proj.\g<p>"),
    ]


_HIERA = r"vision_encoder\.backbone"
_BLOCK = _HIERA + r"\.blocks\.(?P<b>\d+)"
_DOWNSAMPLER = r"memory_encoder\.mask_downsampler"
_FUSER = r"memory_encoder\.memory_fuser\.layers\.(?P<i>\d+)"
_TWO_WAY = r"mask_decoder\.transformer"
_MEMORY_LAYER = r"memory_attention\.layers\.(?P<l>\d+)"
_RULES: list[_Rule] = [
    _rename("no_memory_embedding", "no_mem_embed"),
    _rename("no_memory_positional_encoding", "no_mem_pos_enc"),
    _rename("memory_temporal_positional_encoding", "maskmem_tpos_enc"),
    _rename("no_object_pointer", "no_obj_ptr"),
    _rename("occlusion_spatial_embedding_parameter", "no_obj_embed_spatial"),
    _rename(r"mask_downsample\." + _P, r"mask_downsample.\g<p>"),
    *_mlp(r"object_pointer_proj", "obj_ptr_proj", 3),
    _rename(r"temporal_positional_encoding_projection_layer\." + _P, r"obj_ptr_tpos_proj.\g<p>"),
    # Image encoder: Hiera trunk and FPN neck.
    _rename(_HIERA + r"\.(?P<n>pos_embed|pos_embed_window)", r"image_encoder.trunk.\g<n>"),
    _rename(_HIERA + r"\.patch_embed\.projection\." + _P, r"image_encoder.trunk.patch_embed.proj.\g<p>"),
    _rename(_BLOCK + r"\.layer_norm(?P<k>[12])\." + _P, r"image_encoder.trunk.blocks.\g<b>.norm\g<k>.\g<p>"),
    _rename(_BLOCK + r"\.(?P<n>attn\.qkv|attn\.proj|proj)\." + _P, r"image_encoder.trunk.blocks.\g<b>.\g<n>.\g<p>"),
    *_mlp(_BLOCK + r"\.mlp", r"image_encoder.trunk.blocks.\g<b>.mlp", 2),
    _rename(r"vision_encoder\.neck\.convs\.(?P<i>\d+)\." + _P, r"image_encoder.neck.convs.\g<i>.conv.\g<p>"),
    # Prompt encoder (its point table and positional matrix are handled apart).
    _rename(r"prompt_encoder\.(?P<n>no_mask_embed|not_a_point_embed)\.weight", r"sam_prompt_encoder.\g<n>.weight"),
    *(
        _rename(rf"prompt_encoder\.mask_embed\.{name}\." + _P, rf"sam_prompt_encoder.mask_downscaling.{index}.\g<p>")
        for name, index in (("conv1", 0), ("layer_norm1", 1), ("conv2", 3), ("layer_norm2", 4), ("conv3", 6))
    ),
    # Mask decoder.
    _rename(r"mask_decoder\.(?P<n>iou_token|mask_tokens|obj_score_token)\.weight", r"sam_mask_decoder.\g<n>.weight"),
    _rename(r"mask_decoder\.(?P<n>conv_s0|conv_s1)\." + _P, r"sam_mask_decoder.\g<n>.\g<p>"),
    *(
        _rename(rf"mask_decoder\.{name}\." + _P, rf"sam_mask_decoder.output_upscaling.{index}.\g<p>")
        for name, index in (("upscale_conv1", 0), ("upscale_layer_norm", 1), ("upscale_conv2", 3))
    ),
    *_mlp(
        r"mask_decoder\.output_hypernetworks_mlps\.(?P<m>\d+)", r"sam_mask_decoder.output_hypernetworks_mlps.\g<m>", 3
    ),
    *_mlp(r"mask_decoder\.iou_prediction_head", "sam_mask_decoder.iou_prediction_head", 3),
    *_mlp(r"mask_decoder\.pred_obj_score_head", "sam_mask_decoder.pred_obj_score_head", 3),
    *_attention(
        _TWO_WAY + r"\.(?P<a>layers\.\d+\.(?:self_attn|cross_attn_token_to_image|cross_attn_image_to_token)"
        r"|final_attn_token_to_image)",
        r"sam_mask_decoder.transformer.\g<a>",
    ),
    _rename(
        _TWO_WAY + r"\.layers\.(?P<l>\d+)\.layer_norm(?P<k>[1-4])\." + _P,
        r"sam_mask_decoder.transformer.layers.\g<l>.norm\g<k>.\g<p>",
    ),
    *_mlp(_TWO_WAY + r"\.layers\.(?P<l>\d+)\.mlp", r"sam_mask_decoder.transformer.layers.\g<l>.mlp", 2),
    _rename(_TWO_WAY + r"\.layer_norm_final_attn\." + _P, r"sam_mask_decoder.transformer.norm_final_attn.\g<p>"),
    # Memory attention.
    *_attention(_MEMORY_LAYER + r"\.(?P<a>self_attn|cross_attn_image)", r"memory_attention.layers.\g<l>.\g<a>"),
    _rename(_MEMORY_LAYER + r"\.(?P<n>linear[12])\." + _P, r"memory_attention.layers.\g<l>.\g<n>.\g<p>"),
    _rename(_MEMORY_LAYER + r"\.layer_norm(?P<k>[123])\." + _P, r"memory_attention.layers.\g<l>.norm\g<k>.\g<p>"),
    _rename(r"memory_attention\.layer_norm\." + _P, r"memory_attention.norm.\g<p>"),
    # Memory encoder: the mask downsampler's Sequential counts its activations too (3 per layer).
    _indexed(
        _DOWNSAMPLER + r"\.layers\.(?P<i>\d+)\.conv\." + _P, "memory_encoder.mask_downsampler.encoder", lambda i: 3 * i
    ),
    _indexed(
        _DOWNSAMPLER + r"\.layers\.(?P<i>\d+)\.layer_norm\." + _P,
        "memory_encoder.mask_downsampler.encoder",
        lambda i: 3 * i + 1,
    ),
    _rename(
        _DOWNSAMPLER + r"\.final_conv\." + _P,
        f"memory_encoder.mask_downsampler.encoder.{3 * _MASK_DOWNSAMPLER_LAYERS}" + r".\g<p>",
    ),
    _rename(r"memory_encoder\.feature_projection\." + _P, r"memory_encoder.pix_feat_proj.\g<p>"),
    _rename(_FUSER + r"\.scale", r"memory_encoder.fuser.layers.\g<i>.gamma"),
    _rename(_FUSER + r"\.depthwise_conv\." + _P, r"memory_encoder.fuser.layers.\g<i>.dwconv.\g<p>"),
    _rename(_FUSER + r"\.layer_norm\." + _P, r"memory_encoder.fuser.layers.\g<i>.norm.\g<p>"),
    _rename(_FUSER + r"\.pointwise_conv(?P<k>[12])\." + _P, r"memory_encoder.fuser.layers.\g<i>.pwconv\g<k>.\g<p>"),
    _rename(r"memory_encoder\.projection\." + _P, r"memory_encoder.out_proj.\g<p>"),
]

# The random-Fourier matrix: transformers keeps a copy for prompts and one for the image-wide
# encoding (equal in converted checkpoints); the official model has one.
_FOURIER = ("prompt_encoder.shared_embedding.positional_embedding", "shared_image_embedding.positional_embedding")
_POINT_TABLE = "prompt_encoder.point_embed.weight"
# Buffers transformers derives from the config (RoPE positions and frequencies); the official
# model computes its own. Not written by save_pretrained, but harmless if a file has them.
_DERIVED = ("memory_attention.position_ids", "memory_attention.rotary_emb.inv_freq")
_DERIVED_PREFIX = "memory_attention.rotary_emb."


def official_key(hf_key: str) -> str | None:
    """The official name of a transformers tensor (None for the special cases and unknown keys)."""
    for pattern, rename in _RULES:
        match = pattern.fullmatch(hf_key)
        if match:
            return rename(match)
    return None


def _equal(a: Tensor, b: Tensor) -> bool:
    """Equal tensors (meta tensors, which hold no values, by shape alone)."""
    if a.shape != b.shape:
        return False
    return a.is_meta or b.is_meta or torch.equal(a, b.to(a.device, a.dtype))


def _listing(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def official_state_dict_from_hf(hf_state_dict: Mapping[str, Tensor], config: Sam2Config) -> dict[str, Tensor]:
    """The official state dict (key names as in sam2.1_hiera_*.pt) of a transformers SAM 2
    state dict, `config` being config_from_hf of its config.json.

    Every transformers tensor is used and every official one produced, with the shape `config`
    implies; otherwise UserError lists the keys that are unknown, missing or of the wrong shape."""
    expected = official_shapes(config)
    out: dict[str, Tensor] = {}
    unmapped, problems = [], []

    fourier = [hf_state_dict[key] for key in _FOURIER if key in hf_state_dict]
    if len(fourier) == 2 and not _equal(*fourier):
        problems.append(f"{_FOURIER[0]} and {_FOURIER[1]} differ; the official model has one positional matrix")
    if fourier:
        out["sam_prompt_encoder.pe_layer.positional_encoding_gaussian_matrix"] = fourier[0]
    if _POINT_TABLE in hf_state_dict:
        table = hf_state_dict[_POINT_TABLE]
        if table.dim() != 2 or table.shape[0] != 4:
            problems.append(f"{_POINT_TABLE} has shape {tuple(table.shape)}, where SAM 2 has 4 point embeddings")
        else:
            for i in range(4):
                out[f"sam_prompt_encoder.point_embeddings.{i}.weight"] = table[i : i + 1].clone()

    for hf_key, tensor in hf_state_dict.items():
        if hf_key in _FOURIER or hf_key == _POINT_TABLE:
            continue
        if hf_key in _DERIVED or hf_key.startswith(_DERIVED_PREFIX):
            continue
        key = official_key(hf_key)
        if key is None:
            unmapped.append(hf_key)
        else:
            out[key] = tensor

    missing = sorted(set(expected) - set(out))
    unexpected = sorted(set(out) - set(expected))
    wrong = [
        f"{key} {tuple(out[key].shape)} (expected {expected[key]})"
        for key in sorted(set(out) & set(expected))
        if tuple(out[key].shape) != expected[key]
    ]
    if unmapped:
        problems.append(f"transformers keys with no official counterpart: {_listing(unmapped)}")
    if missing:
        problems.append(f"official keys not in the checkpoint: {_listing(missing)}")
    if unexpected:
        # e.g. SAM 2.1's no-object embedding in a checkpoint whose config says 2.0
        problems.append(f"tensors the {config.release} config has no place for: {_listing(unexpected)}")
    if wrong:
        problems.append(f"tensors of the wrong shape for the config: {_listing(wrong)}")
    if problems:
        raise UserError(f"cannot read this transformers SAM 2 checkpoint as {config.name}: " + "; ".join(problems))
    return out
