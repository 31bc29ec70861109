"""Loading pipelines: clear UserErrors for bad paths (no hub is reachable here)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from genfast.diffusion.pipelines import load_pipeline
from genfast.errors import UserError


def test_missing_directory(tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        load_pipeline(str(tmp_path / "nowhere"))


def test_directory_without_model_index(tmp_path):
    with pytest.raises(UserError, match=r"no model_index\.json"):
        load_pipeline(str(tmp_path))


def test_broken_pipeline_directory(tmp_path):
    (tmp_path / "model_index.json").write_text(
        '{"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}'
    )
    with pytest.raises(UserError, match="could not load a diffusers pipeline"):
        load_pipeline(str(tmp_path))


def test_initial_latents_are_diffusers_own_noise_in_fp32():
    """Passing them changes no fp32 image: the same draw as the pipeline's own from the seed."""
    import torch
    from diffusers.utils.torch_utils import randn_tensor

    from genfast.diffusion.pipelines import initial_latents, tiny_pipeline

    pipe = tiny_pipeline("sd15")
    latents = initial_latents(pipe, 32, 48, seed=7)
    assert latents.dtype == torch.float32 and latents.shape == (1, 4, 16, 24)
    assert torch.equal(latents, randn_tensor((1, 4, 16, 24), generator=torch.Generator().manual_seed(7)))

    def image(**noise):
        out = pipe("a red cat", num_inference_steps=2, height=32, width=48, output_type="pt", **noise)
        return out.images

    own = image(generator=torch.Generator().manual_seed(7))
    assert torch.equal(image(latents=latents, generator=torch.Generator().manual_seed(7)), own)


def test_initial_latents_are_the_fp32_noise_in_every_dtype():
    import torch

    from genfast.diffusion.pipelines import initial_latents, tiny_pipeline

    pipe = tiny_pipeline("sdxl")
    fp32 = initial_latents(pipe, 32, 32, seed=3)
    pipe.to(dtype=torch.bfloat16)
    bf16 = initial_latents(pipe, 32, 32, seed=3)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32.to(torch.bfloat16))


def test_initial_latents_follow_pixarts_resolution_bins():
    """PixArt generates at the aspect-ratio bin nearest the asked size (and resizes back)."""
    from types import SimpleNamespace

    import torch
    from diffusers.image_processor import PixArtImageProcessor

    from genfast.diffusion.pipelines import initial_latents

    class PixArtLike:  # what initial_latents reads of a PixArt pipeline with a 256-pixel table
        vae_scale_factor = 8
        image_processor = PixArtImageProcessor(vae_scale_factor=8)
        transformer = SimpleNamespace(
            config=SimpleNamespace(sample_size=32, in_channels=4), device=torch.device("cpu"), dtype=torch.float32
        )

        def __call__(self, prompt, height=None, width=None, use_resolution_binning=True): ...

    latents = initial_latents(PixArtLike(), 300, 200, seed=0)
    assert latents.shape[:2] == (1, 4) and latents.shape[2:] != (300 // 8, 200 // 8)
    height, width = latents.shape[2] * 8, latents.shape[3] * 8
    assert abs(height / width - 1.5) < 0.1 and height * width <= 256 * 256 * 1.1


def test_building_a_tiny_pipeline_leaves_no_files_behind(tmp_path, monkeypatch):
    """The byte tokenizer's vocabulary files are read when it is built; every tiny pipeline (the
    suite builds hundreds, `genfast imagine --model tiny-*` one per run) used to leave their
    directory in the temporary folder."""
    import tempfile

    from genfast.diffusion.pipelines import tiny_pipeline

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pipe = tiny_pipeline("sdxl")
    assert list(tmp_path.iterdir()) == []
    assert pipe.tokenizer("a cat").input_ids == [512, 353, 99, 97, 372, 513]


def test_loading_a_saved_pipeline_prints_no_library_noise(tmp_path):
    """Every `genfast imagine` printed a diffusers FutureWarning (torch_dtype) and two transformers
    notes about torchvision, none of which a user can act on. In a fresh process: those notes come
    once per process."""
    import os
    import subprocess
    import sys

    from genfast.diffusion.pipelines import tiny_pipeline

    tiny_pipeline("sd15").save_pretrained(tmp_path / "sd15")
    code = f"from genfast.diffusion.pipelines import load_pipeline; load_pipeline({str(tmp_path / 'sd15')!r})"
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert "Warning" not in run.stderr and "[transformers]" not in run.stderr, run.stderr
