"""`genfast segment IMAGE` with SAM 2 models, end to end through cli.main: an official-layout
checkpoint (the real tiny architecture, random weights: no real weights here) gives the masks
the image predictor gives; names, random weights, --auto and user errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from genfast.cli import main
from genfast.errors import UserError
from genfast.interface import images
from genfast.sam.sam2.build import build_random_sam2, load_sam2_checkpoint, to_official_keys
from genfast.sam.sam2.predictor import SAM2ImagePredictor
from tests.sam.test_cli import read_mask, rle_decode

HEIGHT, WIDTH = 60, 80


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sam2_inputs")
    model = build_random_sam2("sam2.1-hiera-tiny", scale=0.05)
    torch.save({"model": to_official_keys(model.state_dict())}, root / "sam2.1_hiera_tiny.pt")
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    image = np.stack([x * 255 // WIDTH, y * 255 // HEIGHT, (x * y) % 256], axis=-1).astype(np.uint8)
    Image.fromarray(image).save(root / "image.png")
    (root / "notes.pt").write_text("not a checkpoint")
    return {"checkpoint": root / "sam2.1_hiera_tiny.pt", "image": root / "image.png", "bad": root / "notes.pt"}


def test_point_masks_match_the_predictor(files, tmp_path, capsys) -> None:
    out, js = tmp_path / "mask.png", tmp_path / "masks.json"
    args = ["segment", str(files["image"]), "--checkpoint", str(files["checkpoint"]), "--point", "30,20"]
    assert main([*args, "--multimask", "-o", str(out), "--json", str(js)]) == 0
    err = capsys.readouterr().err
    assert "sam2.1-hiera-tiny from" in err
    predictor = SAM2ImagePredictor(load_sam2_checkpoint(files["checkpoint"]))
    predictor.set_image(images.load_image(files["image"]))
    masks, scores, _ = predictor.predict(np.array([[30.0, 20.0]]), np.array([1]), multimask_output=True)
    order = np.argsort(-scores, kind="stable")
    document = json.loads(js.read_text())
    assert [m["predicted_iou"] for m in document["masks"]] == pytest.approx(scores[order].tolist(), rel=1e-4)
    for rank, record in enumerate(document["masks"]):
        assert np.array_equal(rle_decode(record["segmentation"]), masks[order[rank]])
    assert np.array_equal(read_mask(out), masks[order[0]])
    assert (tmp_path / "mask-2.png").is_file() and (tmp_path / "mask-3.png").is_file()
    assert (tmp_path / "mask-overlay.png").is_file()


def test_random_weights_auto_by_name(files, tmp_path, capsys) -> None:
    out = tmp_path / "labels.png"
    args = ["segment", str(files["image"]), "--model", "sam2.1-hiera-tiny", "--random-weights", "--auto"]
    assert main([*args, "--points-per-side", "4", "--pred-iou-thresh", "0", "-o", str(out), "--no-overlay"]) == 0
    err = capsys.readouterr().err
    assert "RANDOM weights" in err and "automatic" in err
    with Image.open(out) as labels:
        assert labels.size == (WIDTH, HEIGHT)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "sam2.1-hiera-huge"], "unknown SAM model 'sam2.1-hiera-huge'"),
        (["--model", "sam2.1-hiera-small"], "genfast pull sam2.1-hiera-small"),
        (["--checkpoint", "BAD"], "cannot read SAM checkpoint"),
    ],
)
def test_user_errors(files, tmp_path, capsys, extra: list[str], message: str) -> None:
    extra = [str(files["bad"]) if e == "BAD" else e for e in extra]
    out = tmp_path / "mask.png"
    code = main(["segment", str(files["image"]), "--point", "3,4", "-o", str(out), *extra])
    assert code != 0
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_sam1_file_is_not_read_as_sam2(tmp_path) -> None:
    from genfast.sam.sam2.build import load_sam2_checkpoint

    path = tmp_path / "sam.pt"
    torch.save({"image_encoder.patch_embed.proj.weight": torch.zeros(1)}, path)
    with pytest.raises(UserError, match="not a SAM 2 checkpoint"):
        load_sam2_checkpoint(path)
