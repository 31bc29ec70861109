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
