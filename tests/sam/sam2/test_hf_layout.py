"""transformers-layout SAM 2 checkpoints read as the official layout: a transformers model with
random (perturbed) weights, converted and loaded strictly into the official model, gives the
same image features, masks and scores; its config.json gives the genfast config (the presets'
as the hub repos have them); what genfast cannot run is refused, saying what."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from genfast.errors import UserError  # noqa: E402
from genfast.sam.sam2.config import SAM2_PRESETS, Sam2Config, tiny_sam2_config  # noqa: E402
from genfast.sam.sam2.hf_layout import (  # noqa: E402
    _DECODER_DEFAULTS,
    _HIERA_DEFAULTS,
    _PROMPT_DEFAULTS,
    _TOP_DEFAULTS,
    _VISION_DEFAULTS,
    config_from_hf,
    official_shapes,
    official_state_dict_from_hf,
)
from genfast.sam.sam2.official import build_official_sam2  # noqa: E402
from tests.sam.oracle import randomize_  # noqa: E402

# transformers' memory attention takes 64-channel memories whatever its config says, so the small
# test model keeps tiny_sam2_config's trunk and input but the official mem_dim, and a d_model it
# divides other than 64 (at 64 the official memory encoder has no output projection, transformers'
# always has one).
TINY = tiny_sam2_config(d_model=128, mem_dim=64)
TINY_2_0 = tiny_sam2_config(release="2.0", d_model=128, mem_dim=64)


def _hf_config(config: Sam2Config) -> transformers.Sam2VideoConfig:
    """The transformers config with `config`'s sizes."""
    d, side = config.d_model, config.image_size
    widths = [config.embed_dim * 2**i for i in range(4)]
    hiera = transformers.Sam2HieraDetConfig(
        hidden_size=config.embed_dim,
        embed_dim_per_stage=widths,
        num_attention_heads_per_stage=[config.num_heads * 2**i for i in range(4)],
        blocks_per_stage=list(config.stages),
        global_attention_blocks=list(config.global_att_blocks),
        window_size_per_stage=list(config.window_spec),
        window_positional_embedding_background_size=list(config.window_pos_embed_bkg_spatial_size),
        image_size=[side, side],
    )
    vision = transformers.Sam2VisionConfig(
        backbone_config=hiera,
        backbone_channel_list=widths[::-1],
        backbone_feature_sizes=[[side // 4] * 2, [side // 8] * 2, [side // 16] * 2],
        fpn_hidden_size=d,
        fpn_top_down_levels=list(config.fpn_top_down_levels),
    )
    release_2_1 = config.release == "2.1"
    return transformers.Sam2VideoConfig(
        vision_config=vision,
        prompt_encoder_config={"hidden_size": d, "image_size": side},
        mask_decoder_config={"hidden_size": d},
        image_size=side,
        num_maskmem=config.num_maskmem,
        max_object_pointers_in_encoder=config.max_obj_ptrs_in_encoder,
        memory_attention_hidden_size=d,
        memory_attention_num_layers=config.memory_attention_layers,
        memory_attention_feed_forward_hidden_size=config.memory_attention_ffn_dim,
        memory_attention_rope_feat_sizes=[side // 16] * 2,
        memory_encoder_hidden_size=d,
        memory_encoder_output_channels=config.mem_dim,
        mask_downsampler_embed_dim=d,
        memory_fuser_embed_dim=d,
        memory_fuser_intermediate_dim=4 * d,
        enable_occlusion_spatial_embedding=release_2_1,
        enable_temporal_pos_encoding_for_object_pointers=release_2_1,
    )


def _hub_config(size: str, release: str) -> transformers.Sam2VideoConfig:
    """The config of the hub's facebook/sam2{,.1}-hiera-{size} as transformers' conversion
    script writes it: trunk overrides on its defaults (the tiny model), heads set per stage only
    (the top-level num_attention_heads stays 1), and one switch per release for both of 2.1's
    tracker additions."""
    trunk = {
        "tiny": {},
        "small": {"blocks_per_stage": [1, 2, 11, 2], "global_attention_blocks": [7, 10, 13]},
        "base-plus": {
            "hidden_size": 112,
            "embed_dim_per_stage": [112, 224, 448, 896],
            "num_attention_heads_per_stage": [2, 4, 8, 16],
            "blocks_per_stage": [2, 3, 16, 3],
            "global_attention_blocks": [12, 16, 20],
            "window_positional_embedding_background_size": [14, 14],
        },
        "large": {
            "hidden_size": 144,
            "embed_dim_per_stage": [144, 288, 576, 1152],
            "num_attention_heads_per_stage": [2, 4, 8, 16],
            "blocks_per_stage": [2, 6, 36, 4],
            "global_attention_blocks": [23, 33, 43],
            "window_size_per_stage": [8, 4, 16, 8],
        },
    }[size]
    hiera = transformers.Sam2HieraDetConfig(**trunk)
    vision = transformers.Sam2VisionConfig(backbone_config=hiera, backbone_channel_list=hiera.embed_dim_per_stage[::-1])
    flag = release == "2.1"
    return transformers.Sam2VideoConfig(
        vision_config=vision,
        enable_occlusion_spatial_embedding=flag,
        enable_temporal_pos_encoding_for_object_pointers=flag,
    )


def _json(config: transformers.PreTrainedConfig) -> dict:
    """config.json as save_pretrained writes it (fields at their defaults may be left out)."""
    return json.loads(config.to_json_string())


def _image_model(hf_config: transformers.Sam2VideoConfig) -> transformers.Sam2Model:
    """transformers' single-image model over the same sub-configs."""

    def plain(sub: transformers.PreTrainedConfig) -> dict:
        return {k: v for k, v in sub.to_dict().items() if k != "model_type"}

    config = transformers.Sam2Config(
        vision_config=hf_config.vision_config,
        prompt_encoder_config=plain(hf_config.prompt_encoder_config),
        mask_decoder_config=plain(hf_config.mask_decoder_config),
    )
    return transformers.Sam2Model(config).eval()


_CACHE: dict[str, tuple[dict, torch.nn.Module, torch.nn.Module, Sam2Config]] = {}


def _pair(name: str) -> tuple[dict, torch.nn.Module, torch.nn.Module, Sam2Config]:
    """A perturbed transformers SAM 2 (its state dict, and the image model loaded from it) and
    the official model loaded from the conversion."""
    if name not in _CACHE:
        hf_config = {
            "tiny": _hf_config(TINY),
            "tiny-2.0": _hf_config(TINY_2_0),
            "hub-tiny": _hub_config("tiny", "2.1"),
        }[name]
        torch.manual_seed(0)
        video = transformers.Sam2VideoModel(hf_config).eval()
        randomize_(video, seed=1)
        state = video.state_dict()
        # Converted checkpoints hold one random-Fourier matrix twice; keep them equal.
        state["shared_image_embedding.positional_embedding"].copy_(
            state["prompt_encoder.shared_embedding.positional_embedding"]
        )
        image = _image_model(hf_config)
        missing, unexpected = image.load_state_dict(state, strict=False)
        assert not missing
        assert unexpected and all(
            key.startswith(("memory_", "mask_downsample", "object_pointer_proj", "temporal_positional"))
            or key in ("no_memory_positional_encoding", "no_object_pointer", "occlusion_spatial_embedding_parameter")
            for key in unexpected
        )
        config = config_from_hf(_json(hf_config))
        official = build_official_sam2(config, video=True)
        official.load_state_dict(official_state_dict_from_hf(state, config), strict=True)
        _CACHE[name] = (state, image, official, config)
    return _CACHE[name]


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> float:
    """Max abs error, asserted below rel * (1 + max |expected|)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= rel * (1 + expected.abs().max().item()), f"max abs error {err:.3g}"
    return err


# fp32 on the CPU. Nothing differs by design: the image features come out bit-identical; the
# masks differ by at most 8e-7 of their largest logit (the decoder's attention and LayerNorm2d
# computed in another order), the scores by 1e-7.
REL = 1e-5


def _official_prediction(
    official: torch.nn.Module,
    features: list[torch.Tensor],
    points: torch.Tensor | None,
    labels: torch.Tensor | None,
    box: torch.Tensor | None,
    multimask: bool,
) -> tuple[torch.Tensor, ...]:
    """What SAM2ImagePredictor.predict computes: a box becomes two corner points (labels 2 and
    3) ahead of the clicks, and the prompt encoder pads with a not-a-point."""
    if box is not None:
        corners, corner_labels = box.reshape(1, 2, 2), torch.tensor([[2, 3]], dtype=torch.int32)
        points = corners if points is None else torch.cat([corners, points], dim=1)
        labels = corner_labels if labels is None else torch.cat([corner_labels, labels], dim=1)
    sparse, dense = official.sam_prompt_encoder(points=(points, labels), boxes=None, masks=None)
    masks, iou, _, object_score = official.sam_mask_decoder(
        image_embeddings=features[-1],
        image_pe=official.sam_prompt_encoder.get_dense_pe(),
        sparse_prompt_embeddings=sparse,
        dense_prompt_embeddings=dense,
        multimask_output=multimask,
        repeat_image=False,
        high_res_features=features[:-1],
    )
    return masks, iou, object_score


@pytest.mark.parametrize("name", ["tiny", "tiny-2.0", pytest.param("hub-tiny", marks=pytest.mark.slow)])
def test_converted_model_matches_transformers(name: str) -> None:
    _, image, official, config = _pair(name)
    side = config.image_size
    gen = torch.Generator().manual_seed(3)
    pixels = torch.randn(1, 3, side, side, generator=gen)
    with torch.no_grad():
        # The image encoder: FPN levels (finest first) and their position encodings.
        hf_vision = image.vision_encoder(pixels)
        official_encoder = official.image_encoder(pixels)
        levels = official_encoder["backbone_fpn"]
        assert len(hf_vision.fpn_hidden_states) == len(levels) == 3
        for hf_level, level in zip(hf_vision.fpn_hidden_states, levels):
            _close(hf_level, level, REL)
        for hf_pos, pos in zip(hf_vision.fpn_position_encoding, official_encoder["vision_pos_enc"]):
            _close(hf_pos, pos, REL)

        # The features the decoder reads (high-resolution levels projected, no-memory embedding
        # added), as the image predictor prepares them.
        _, vision_feats, _, feat_sizes = official._prepare_backbone_features(official.forward_image(pixels))
        vision_feats[-1] = vision_feats[-1] + official.no_mem_embed
        features = [f.permute(1, 2, 0).view(1, -1, *size) for f, size in zip(vision_feats, feat_sizes)]
        hf_features = image.get_image_embeddings(pixels)
        for hf_feature, feature in zip(hf_features, features):
            _close(hf_feature, feature, REL)

        s = side / 128  # prompts placed for any input size
        points = torch.tensor([[[30.0, 40.0], [90.5, 70.0]]]) * s
        labels = torch.tensor([[1, 0]], dtype=torch.int32)
        box = torch.tensor([[20.0, 25.0, 100.0, 110.0]]) * s
        prompts = [(points, labels, None), (None, None, box), (points[:, :1], labels[:, :1], box)]
        for point_prompt, label_prompt, box_prompt in prompts:
            for multimask in (True, False):
                hf = image(
                    image_embeddings=hf_features,
                    input_points=None if point_prompt is None else point_prompt[:, None],
                    input_labels=None if label_prompt is None else label_prompt[:, None],
                    input_boxes=None if box_prompt is None else box_prompt[:, None],
                    multimask_output=multimask,
                )
                masks, iou, object_score = _official_prediction(
                    official, features, point_prompt, label_prompt, box_prompt, multimask
                )
                assert masks.shape[1] == (3 if multimask else 1)
                _close(hf.pred_masks[:, 0], masks, REL)
                _close(hf.iou_scores[:, 0], iou, REL)
                _close(hf.object_score_logits[:, 0], object_score, REL)


@pytest.mark.parametrize("config", [TINY, TINY_2_0], ids=["2.1", "2.0"])
def test_config_round_trip(config: Sam2Config) -> None:
    assert config_from_hf(_json(_hf_config(config))).same_shapes(config)


@pytest.mark.parametrize("name", list(SAM2_PRESETS))
def test_hub_configs_are_the_presets(name: str) -> None:
    release, size = name.removeprefix("sam").split("-hiera-")
    hf_config = _hub_config(size, "2.1" if release == "2.1" else "2.0")
    assert config_from_hf(_json(hf_config)) == SAM2_PRESETS[name]
    # Every tensor of a model of that config maps to the official one of the same shape (read
    # without values, on the meta device), and the table of official shapes is the package's.
    with torch.device("meta"):
        state = transformers.Sam2VideoModel(hf_config).state_dict()
    converted = official_state_dict_from_hf(state, SAM2_PRESETS[name])
    official = build_official_sam2(SAM2_PRESETS[name], video=True).state_dict()
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in official.items()}
    assert official_shapes(SAM2_PRESETS[name]) == {k: tuple(v.shape) for k, v in official.items()}


def test_defaults_are_transformers_defaults() -> None:
    """config.json leaves out fields at transformers' defaults; genfast fills in the same."""
    video = transformers.Sam2VideoConfig()
    sections = [
        (_TOP_DEFAULTS, video),
        (_VISION_DEFAULTS, transformers.Sam2VisionConfig()),
        (_HIERA_DEFAULTS, transformers.Sam2HieraDetConfig()),
        (_PROMPT_DEFAULTS, video.prompt_encoder_config),
        (_DECODER_DEFAULTS, video.mask_decoder_config),
    ]
    for defaults, config in sections:
        for field, value in defaults.items():
            actual = getattr(config, field)
            assert list(actual) == list(value) if isinstance(value, list) else actual == value, field
    assert config_from_hf({"model_type": "sam2_video"}) == SAM2_PRESETS["sam2.1-hiera-tiny"]


def test_config_refusals() -> None:
    with pytest.raises(UserError, match="image-only"):
        config_from_hf(_json(transformers.Sam2Config()))
    with pytest.raises(UserError, match="not a SAM 2 checkpoint: model_type 'llama'"):
        config_from_hf({"model_type": "llama"})

    def refused(**changes: object) -> str:
        config = _json(_hub_config("tiny", "2.1"))
        for path, value in changes.items():
            *parents, field = path.split("__")
            section = config
            for parent in parents:
                section = section[parent]
            section[field] = value
        with pytest.raises(UserError) as error:
            config_from_hf(config)
        return str(error.value)

    assert "mask_decoder_config.num_attention_heads is 4, where SAM 2 has 8" in refused(
        mask_decoder_config__num_attention_heads=4
    )
    assert "memory_encoder_output_channels is 32" in refused(memory_encoder_output_channels=32)
    assert "SAM 2.1 has both, 2.0 neither" in refused(enable_occlusion_spatial_embedding=False)
    assert "do not double" in refused(vision_config__backbone_config__num_attention_heads_per_stage=[1, 2, 2, 4])
    assert "vision_config.backbone_config.mlp_ratio is 3.0" in refused(vision_config__backbone_config__mlp_ratio=3.0)
    assert "memory_attention_rope_feat_sizes" in refused(memory_attention_rope_feat_sizes=[32, 32])
    assert "the official model has no projection" in refused(vision_config__fpn_hidden_size=64)
    both = refused(max_cond_frame_num=2, mask_decoder_config__iou_head_depth=4)
    assert "max_cond_frame_num is 2" in both and "iou_head_depth is 4" in both


def test_state_dict_refusals() -> None:
    state, _, _, config = _pair("tiny")
    official_state_dict_from_hf(state, config)

    def refused(state: dict, config: Sam2Config = config) -> str:
        with pytest.raises(UserError) as error:
            official_state_dict_from_hf(state, config)
        return str(error.value)

    missing = dict(state)
    del missing["mask_decoder.conv_s0.bias"]
    assert "official keys not in the checkpoint: sam_mask_decoder.conv_s0.bias" in refused(missing)
    extra = {**state, "vision_encoder.backbone.blocks.0.attn.rel_pos": torch.zeros(1)}
    assert "no official counterpart: vision_encoder.backbone.blocks.0.attn.rel_pos" in refused(extra)
    # 2.1's weights under a 2.0 config: its no-object embedding and time projection have no place.
    message = refused(state, dataclasses.replace(config, release="2.0"))
    assert "no_obj_embed_spatial" in message and "obj_ptr_tpos_proj.weight" in message
    # 2.0's weights under a 2.1 config: they are missing.
    state_2_0 = _pair("tiny-2.0")[0]
    assert "no_obj_embed_spatial" in refused(state_2_0)
    fourier = {**state, "shared_image_embedding.positional_embedding": torch.zeros(2, config.d_model // 2)}
    assert "differ" in refused(fourier)
    narrow = {**state, "no_object_pointer": torch.zeros(1, 8)}
    assert "no_obj_ptr (1, 8) (expected (1, 128))" in refused(narrow)
    # Either copy of the positional matrix alone is enough.
    for key in ("shared_image_embedding.positional_embedding", "prompt_encoder.shared_embedding.positional_embedding"):
        official_state_dict_from_hf({k: v for k, v in state.items() if k != key}, config)


def test_a_saved_transformers_folder_loads_into_genfast(tmp_path) -> None:
    """End to end: save_pretrained's folder (config.json + model.safetensors) loads with
    load_sam2_checkpoint and predicts what the official model does with the converted weights."""
    import numpy as np

    from genfast.sam.sam2.build import load_sam2_checkpoint
    from genfast.sam.sam2.official import import_sam2
    from genfast.sam.sam2.predictor import SAM2ImagePredictor

    state, _, official, config = _pair("tiny")
    hf_model = transformers.Sam2VideoModel(_hf_config(TINY)).eval()
    hf_model.load_state_dict(state, strict=True)
    hf_model.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").is_file() and list(tmp_path.glob("*.safetensors"))
    ours = load_sam2_checkpoint(tmp_path)
    assert ours.config.same_shapes(config)
    assert load_sam2_checkpoint(next(tmp_path.glob("*.safetensors"))).config.same_shapes(config)

    import_sam2()
    from sam2.sam2_image_predictor import SAM2ImagePredictor as OfficialPredictor

    reference = OfficialPredictor(official)
    grid = config.image_embedding_size
    reference._bb_feat_sizes = [(4 * grid, 4 * grid), (2 * grid, 2 * grid), (grid, grid)]
    predictor = SAM2ImagePredictor(ours)
    image = np.random.default_rng(0).integers(0, 256, (70, 90, 3), dtype=np.uint8)
    predictor.set_image(image)
    reference.set_image(image)
    prompt = dict(point_coords=np.array([[30.0, 20.0]]), point_labels=np.array([1]), return_logits=True)
    for a, b in zip(predictor.predict(**prompt), reference.predict(**prompt)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
