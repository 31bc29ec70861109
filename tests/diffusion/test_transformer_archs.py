"""FLUX.1 and SD 3.5 at their real sizes (genfast.diffusion.transformer_archs): the published
parameter counts from the configs alone (meta device), the block override, and weights drawn in
bf16, the same for a seed (at toy widths: the real ones take tens of GB)."""

from __future__ import annotations

import pytest
import torch

from genfast.diffusion import transformer_archs as archs
from genfast.diffusion.pipelines import _tiny_tokenizer

# Elements of each transformer checkpoint (diffusion_pytorch_model*.safetensors on the hub):
# FLUX.1-schnell 11,891,178,560 and -dev 11,901,408,320 (dev adds the guidance embedder), SD 3.5
# medium 2,469,663,936 (with its 384x384 position table, a persistent buffer of 226 M).
PUBLISHED_TRANSFORMERS = {"flux-schnell": 11_891_178_560, "flux-dev": 11_901_408_320, "sd35-medium": 2_469_663_936}


@pytest.mark.parametrize("name, elements", PUBLISHED_TRANSFORMERS.items())
def test_transformers_have_the_published_parameter_counts(name, elements):
    assert archs.parameter_counts(name)["transformer"] == elements


def test_sd35_large_and_the_shared_components_have_their_published_sizes():
    """SD 3.5-large: Stability's 8.1 B; the VAE's checkpoint 83,819,683 elements; CLIP-L's text
    tower 123.1 M (SD 3.5's with its projection 123.7 M), CLIP-G's 694.7 M, T5-XXL's encoder 4.76 B."""
    large = archs.parameter_counts("sd35-large")
    assert large["transformer"] == pytest.approx(8.1e9, rel=0.01)
    assert large["vae"] == 83_819_683
    assert large["text_encoder"] == 123_650_304 and large["text_encoder_2"] == 694_659_840
    assert large["text_encoder_3"] == pytest.approx(4.76e9, rel=0.001)
    flux = archs.parameter_counts("flux-schnell")
    assert flux["text_encoder"] == 123_060_480 and flux["text_encoder_2"] == large["text_encoder_3"]


def test_the_block_override_keeps_the_block_kinds_and_cuts_the_text_encoders_alike():
    flux = archs.ARCHS["flux-dev"]
    assert flux.full_blocks == 57
    full = flux.depth(None)
    assert full.transformer == {"num_layers": 19, "num_single_layers": 38}
    assert full.encoders == {"text_encoder": 12, "text_encoder_2": 24}
    three = flux.depth(3)  # FLUX.1's 1:2 ratio of double- to single-stream blocks
    assert three.transformer == {"num_layers": 1, "num_single_layers": 2}
    assert three.encoders == {"text_encoder": 1, "text_encoder_2": 1}
    assert "3 of 57 blocks (1 double-stream + 2 single-stream)" in three.describe()
    medium = archs.ARCHS["sd35-medium"]
    assert medium.depth(None).transformer["dual_attention_layers"] == tuple(range(13))
    assert medium.depth(4).transformer == {"num_layers": 4, "dual_attention_layers": (0, 1)}
    assert medium.depth(4).encoders == {"text_encoder": 2, "text_encoder_2": 5, "text_encoder_3": 4}
    assert archs.ARCHS["sd35-large"].depth(2).transformer == {"num_layers": 2, "dual_attention_layers": ()}
    for blocks in (0, 58):
        with pytest.raises(ValueError, match="57 transformer blocks"):
            flux.depth(blocks)


def test_fewer_blocks_count_fewer_parameters():
    full, three = archs.parameter_counts("flux-dev"), archs.parameter_counts("flux-dev", 3)
    assert three["vae"] == full["vae"]  # the VAE is always whole
    assert 0.04 < three["transformer"] / full["transformer"] < 0.07  # 3 of 57 blocks and the embedders
    assert three["text_encoder_2"] < full["text_encoder_2"] / 10


def _toy(family: str) -> archs.DitArch:
    """An architecture of the family at toy widths, through the same builder as the real ones."""
    clip = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, projection_dim=32)
    t5 = dict(vocab_size=600, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu")
    vae = dict(
        latent_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=1.5,
        shift_factor=0.1,
    )
    if family == "flux":
        transformer = dict(
            in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 4, 8),
        )  # fmt: skip
        encoders = {"text_encoder": ("CLIPTextModel", clip), "text_encoder_2": ("T5EncoderModel", t5)}
    else:
        transformer = dict(
            sample_size=16, patch_size=2, in_channels=4, num_layers=6, attention_head_dim=8, num_attention_heads=4,
            joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=64, out_channels=4,
            pos_embed_max_size=16, dual_attention_layers=(0, 1, 2), qk_norm="rms_norm",
        )  # fmt: skip
        clip_encoder = ("CLIPTextModelWithProjection", clip)
        encoders = {
            "text_encoder": clip_encoder,
            "text_encoder_2": clip_encoder,
            "text_encoder_3": ("T5EncoderModel", t5),
        }
    return archs.DitArch(f"toy-{family}", family, transformer, vae, {"shift": 3.0}, encoders)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_weights_are_drawn_in_bf16_and_the_same_for_a_seed(family):
    tokenizer = _tiny_tokenizer()
    build = lambda seed: archs.build_pipeline(_toy(family), blocks=3, seed=seed, tokenizer=tokenizer)  # noqa: E731
    pipe, again, other = build(0), build(0), build(1)
    assert torch.get_default_dtype() == torch.float32  # restored after the build
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        weights = getattr(pipe, name).state_dict()
        assert {t.dtype for t in getattr(pipe, name).parameters()} == {torch.bfloat16}, name
        same = getattr(again, name).state_dict()
        assert all(torch.equal(weights[k], same[k]) for k in weights), name
    drawn, redrawn = pipe.transformer.state_dict(), other.transformer.state_dict()
    assert not all(torch.equal(drawn[k], redrawn[k]) for k in drawn)
    blocks = len(pipe.transformer.transformer_blocks) + len(getattr(pipe.transformer, "single_transformer_blocks", []))
    assert blocks == 3


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_a_toy_build_generates_an_image(family):
    from genfast.diffusion.pipelines import initial_latents

    pipe = archs.build_pipeline(_toy(family), blocks=2, tokenizer=_tiny_tokenizer())
    with torch.inference_mode():
        image = pipe(
            "a lighthouse",
            height=32,
            width=32,
            num_inference_steps=1,
            latents=initial_latents(pipe, 32, 32, seed=0),
            output_type="pt",
            max_sequence_length=16,
        ).images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image.float()).all()


@pytest.mark.slow
def test_a_real_width_block_is_built_in_bf16():
    """One block of SD 3.5-large at its real width (about 10 s and 2.5 GB): bf16 throughout."""
    from genfast.diffusion.pipelines import random_pipeline

    pipe = random_pipeline("sd35-large", blocks=1)
    assert len(pipe.transformer.transformer_blocks) == 1
    assert pipe.transformer.config.num_attention_heads == 38 and pipe.text_encoder_3.config.d_model == 4096
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        assert {p.dtype for p in getattr(pipe, name).parameters()} == {torch.bfloat16}, name


def test_random_pipeline_takes_a_block_count_for_dits_only():
    from genfast.diffusion.pipelines import DIT_ARCHS, REAL_ARCHS, random_pipeline

    assert set(DIT_ARCHS) == set(archs.ARCHS) and set(DIT_ARCHS) < set(REAL_ARCHS)
    with pytest.raises(ValueError, match="UNet"):
        random_pipeline("sd15", blocks=2)
    with pytest.raises(ValueError, match="unknown architecture"):
        random_pipeline("flux-pro")
