"""SAM 2's modules and checkpoint loading against the official package."""

from __future__ import annotations

import pytest
import torch

from genfast.errors import UserError
from genfast.sam.sam2.build import (
    build_random_sam2,
    config_from_state_dict,
    from_official_keys,
    load_sam2_checkpoint,
    to_official_keys,
)
from genfast.sam.sam2.config import SAM2_PRESETS, sam2_preset, tiny_sam2_config
from genfast.sam.sam2.modeling.model import Sam2
from genfast.sam.sam2.official import build_official_sam2
from tests.sam.sam2.oracle import twin_models


@pytest.mark.parametrize("name", list(SAM2_PRESETS))
def test_every_preset_has_the_official_architecture(name: str) -> None:
    """Same parameter names and shapes as the official model (ours on the meta device; the official
    one cannot be built there), and the preset is recognized from those shapes alone."""
    config = SAM2_PRESETS[name]
    official = build_official_sam2(config).state_dict()
    with torch.device("meta"):
        ours = to_official_keys(Sam2(config).state_dict())
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in official.items()}
    assert config_from_state_dict(official) == config


def test_parameter_counts_of_the_official_models() -> None:
    """The published sizes: 38.9M (tiny), 46M (small), 80.8M (base+), 224.4M (large)."""
    expected = {"tiny": 38.9, "small": 46.0, "base-plus": 80.8, "large": 224.4}
    for size, millions in expected.items():
        with torch.device("meta"):
            model = Sam2(sam2_preset(f"sam2.1-hiera-{size}"))
        assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, abs=0.25)


@pytest.fixture(scope="module")
def twins():
    return twin_models(tiny_sam2_config(), video=True)


def test_image_features_match_official(twins) -> None:
    ours, official = twins
    images = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        features, position = ours.forward_image(images)
        reference = official.forward_image(images)
    for a, b in zip(features, reference["backbone_fpn"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # The only encoding any path reads (the official model's memory attention takes [-1:]).
    torch.testing.assert_close(position, reference["vision_pos_enc"][-1], atol=1e-6, rtol=0)


def test_folded_high_res_projections_match_official() -> None:
    """The recipe's fold of the decoder's conv_s0/conv_s1 into the neck (compile step): the same
    image features as the official model's, through one projection of the trunk's channels."""
    ours, official = twin_models(tiny_sam2_config(), seed=3)
    ours.fold_high_res_projections()
    ours.fold_high_res_projections()  # a second call changes nothing
    decoder, neck = ours.sam_mask_decoder, ours.image_encoder.neck
    assert isinstance(decoder.conv_s0, torch.nn.Identity) and isinstance(decoder.conv_s1, torch.nn.Identity)
    d_model = ours.config.d_model
    assert [lateral.conv.out_channels for lateral in neck.convs[-2:]] == [d_model // 4, d_model // 8]
    images = torch.randn(2, 3, 128, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        features, _ = ours.forward_image(images)
        reference = official.forward_image(images)
    for a, b in zip(features, reference["backbone_fpn"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_precomputed_position_embedding_matches_official() -> None:
    """The recipe's position embedding made once (compile step): the official model's features at
    the model's input size; another size computes its own, as before."""
    ours, official = twin_models(tiny_sam2_config(), seed=4)
    ours.precompute_position_embedding()
    trunk = ours.image_encoder.trunk
    grid = ours.image_size // 4
    assert trunk.precomputed_position.shape == (1, grid, grid, trunk.pos_embed.shape[1])
    assert "precomputed_position" not in ours.state_dict()  # checkpoints are unchanged
    generator = torch.Generator().manual_seed(4)
    for size in (ours.image_size, ours.image_size + 32):
        images = torch.randn(1, 3, size, size, generator=generator)
        with torch.no_grad():
            features, _ = ours.forward_image(images)
            reference = official.forward_image(images)
        for a, b in zip(features, reference["backbone_fpn"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("multimask", [True, False])
@pytest.mark.parametrize("prompt", ["points", "mask", "points and mask", "nothing"])
def test_sam_heads_match_official(twins, prompt: str, multimask: bool) -> None:
    ours, official = twins
    generator = torch.Generator().manual_seed(1)
    b, d, g = 2, ours.config.d_model, ours.config.image_embedding_size
    features = torch.randn(b, d, g, g, generator=generator)
    high_res = (
        torch.randn(b, d // 8, 4 * g, 4 * g, generator=generator),
        torch.randn(b, d // 4, 2 * g, 2 * g, generator=generator),
    )
    points = (torch.rand(b, 2, 2, generator=generator) * 128, torch.tensor([[1, 0], [1, 1]], dtype=torch.int32))
    mask = torch.randn(b, 1, 4 * g * 2, 4 * g * 2, generator=generator)  # not the prompt size: resized
    point_inputs = points if "points" in prompt else None
    mask_inputs = mask if "mask" in prompt else None
    with torch.no_grad():
        got = ours.forward_sam_heads(features, point_inputs, mask_inputs, high_res, multimask)
        official_points = None if point_inputs is None else {"point_coords": points[0], "point_labels": points[1]}
        expected = official._forward_sam_heads(features, official_points, mask_inputs, list(high_res), multimask)
    names = ["multimasks", "multimasks_high_res", "ious", "masks", "masks_high_res", "obj_ptr", "object_score_logits"]
    for name, reference in zip(names, expected):
        torch.testing.assert_close(got[name], reference, atol=1e-4, rtol=1e-4, msg=name)


def test_mask_as_output_matches_official(twins) -> None:
    ours, official = twins
    generator = torch.Generator().manual_seed(2)
    d, g = ours.config.d_model, ours.config.image_embedding_size
    features = torch.randn(2, d, g, g, generator=generator)
    high_res = (
        torch.randn(2, d // 8, 4 * g, 4 * g, generator=generator),
        torch.randn(2, d // 4, 2 * g, 2 * g, generator=generator),
    )
    mask = (torch.rand(2, 1, 128, 128, generator=generator) > 0.7).float()
    mask[1] = 0  # an empty mask: the object is absent
    with torch.no_grad():
        got = ours.use_mask_as_output(features, high_res, mask)
        expected = official._use_mask_as_output(features, list(high_res), mask)
    names = ["multimasks", "multimasks_high_res", "ious", "masks", "masks_high_res", "obj_ptr", "object_score_logits"]
    for name, reference in zip(names, expected):
        torch.testing.assert_close(got[name], reference, atol=1e-4, rtol=1e-4, msg=name)


def test_official_checkpoint_file_round_trip(tmp_path, twins) -> None:
    ours, official = twins
    path = tmp_path / "tiny.pt"
    torch.save({"model": official.state_dict()}, path)
    loaded = load_sam2_checkpoint(path, config=ours.config)
    for key, value in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert not loaded.training
    # Without a config, a trunk that is no official model is refused, naming what it found.
    with pytest.raises(UserError, match="none of the official SAM 2 models"):
        load_sam2_checkpoint(path)


def test_key_renaming_round_trips() -> None:
    state = build_random_sam2(tiny_sam2_config()).state_dict()
    assert from_official_keys(to_official_keys(state)).keys() == state.keys()
    assert any(".mlp.layers.0." in k for k in to_official_keys(state) if "transformer" in k)


def test_bad_checkpoints_are_user_errors(tmp_path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_sam2_checkpoint(tmp_path / "missing.pt")
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint")
    with pytest.raises(UserError, match="cannot read SAM 2 checkpoint"):
        load_sam2_checkpoint(garbage)
    sam1 = tmp_path / "sam1.pt"
    torch.save({"image_encoder.patch_embed.proj.weight": torch.zeros(1)}, sam1)
    with pytest.raises(UserError, match="not a SAM 2 checkpoint"):
        load_sam2_checkpoint(sam1)
    wrong = tmp_path / "wrong.pt"
    state = to_official_keys(build_random_sam2(tiny_sam2_config()).state_dict())
    torch.save({"model": state}, wrong)
    with pytest.raises(UserError, match="do not match"):
        load_sam2_checkpoint(wrong, config=tiny_sam2_config(d_model=64))
    with pytest.raises(UserError, match="not a SAM 2 model folder"):
        load_sam2_checkpoint(tmp_path)


def test_unknown_preset_is_a_user_error() -> None:
    with pytest.raises(UserError, match="unknown SAM 2 model"):
        sam2_preset("sam2.1-hiera-huge")


def test_upscaling_convolutions_keep_the_map_channels_last() -> None:
    """The decoder's transposed convolutions with the weight re-laid out: the plain convolution's
    values, written channels-last for a channels-last input (the tokens' view, the encoder's
    high-resolution features), where the weight as stored gives [B, C, H, W]."""
    from genfast.sam.sam2.modeling.decoder import channels_last_conv_transpose

    generator = torch.Generator().manual_seed(7)
    conv = torch.nn.ConvTranspose2d(32, 8, kernel_size=2, stride=2)
    tokens = torch.randn(2, 36, 32, generator=generator)
    image = tokens.transpose(1, 2).reshape(2, 32, 6, 6)  # as the decoder views its image tokens
    assert image.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        out = channels_last_conv_transpose(conv, image)
        torch.testing.assert_close(out, conv(image.contiguous()), atol=1e-6, rtol=1e-5)
    assert out.shape == (2, 8, 12, 12) and out.is_contiguous(memory_format=torch.channels_last)
