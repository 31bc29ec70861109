"""`genfast.Segmenter`: the masks equal `genfast segment`'s for the same images and prompt (one
image at a time on the command line, batched here), automatic masks too; it pickles as its
arguments; as a Ray Data callable it segments an `image` column and names the bad rows."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import genfast
from genfast.cli import main
from genfast.errors import UserError
from genfast.sam.build import build_sam
from genfast.sam.segmenter import masks_json
from tests.sam.oracle import randomize_
from tests.sam.test_batch_command import SIZES, picture
from tests.sam.test_cli import rle_decode
from tests.sam.test_modeling import TINY


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, list[Path], genfast.Segmenter]:
    root = tmp_path_factory.mktemp("segmenter")
    torch.manual_seed(0)
    model = build_sam(TINY)
    randomize_(model, scale=0.1)
    torch.save(model.state_dict(), root / "tiny.pth")
    paths = []
    for i, (h, w) in enumerate(SIZES[:3]):
        paths.append(root / f"photo-{i}.png")
        Image.fromarray(picture(h, w, i)).save(paths[-1])
    segmenter = genfast.Segmenter(
        checkpoint=str(root / "tiny.pth"),
        threads=1,
        batch_size=2,
        points_per_side=4,
        pred_iou_thresh=0.0,
        stability_score_thresh=0.0,
    )
    return root / "tiny.pth", paths, segmenter


def command_masks(checkpoint: Path, image: Path, tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / f"{image.stem}-{len(list(tmp_path.glob('*.json')))}.json"
    args = ["segment", str(image), "--checkpoint", str(checkpoint), "--threads", "1", "--json", str(out), *flags]
    assert main(args) == 0
    return json.loads(out.read_text())["masks"]


def assert_same_masks(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a["predicted_iou"] == pytest.approx(b["predicted_iou"], rel=1e-4, abs=1e-5)
        assert np.array_equal(rle_decode(a["segmentation"]), rle_decode(b["segmentation"]))


def test_prompted_masks_equal_the_command_and_images_are_batched(setup, tmp_path):
    checkpoint, paths, segmenter = setup
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    results = segmenter.segment([arrays[0], paths[1], arrays[2]], points=[[12, 15]], multimask=True)
    assert len(results) == 3
    for path, result in zip(paths, results, strict=True):
        want = command_masks(checkpoint, path, tmp_path, "--point", "12,15", "--multimask")
        got = json.loads(masks_json(result))
        assert_same_masks(got, want)
        assert all(mask.dtype == bool and mask.shape == arrays[paths.index(path)].shape[:2] for mask in result.masks)
    [one] = segmenter.segment(arrays[0], points=[[12, 15]], labels=[1], box=[2, 3, 30, 30])  # a single image
    want = command_masks(checkpoint, paths[0], tmp_path, "--point", "12,15", "--label", "1", "--box", "2,3,30,30")
    assert_same_masks(json.loads(masks_json(one)), want)


def test_everything_equals_the_automatic_command(setup, tmp_path):
    checkpoint, paths, segmenter = setup
    [result] = segmenter.segment_everything(paths[0])
    want = command_masks(
        checkpoint,
        paths[0],
        tmp_path,
        "--auto",
        "--points-per-side",
        "4",
        "--pred-iou-thresh",
        "0",
        "--stability-score-thresh",
        "0",
    )
    assert len(result.masks) == len(want) > 0
    for mask, record in zip(result.masks, want, strict=True):
        assert np.array_equal(mask, rle_decode(record["segmentation"]))


def test_pickles_as_its_arguments(setup):
    _, paths, segmenter = setup
    copy = pickle.loads(pickle.dumps(segmenter))
    assert copy is not segmenter and copy.model is not segmenter.model
    [a] = segmenter.segment(paths[0], points=[[5, 5]])
    [b] = copy.segment(paths[0], points=[[5, 5]])
    assert np.array_equal(a.masks[0], b.masks[0])


def test_a_ray_batch_names_its_bad_rows(setup):
    _, paths, segmenter = setup
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    column = np.empty(5, dtype=object)
    column[:] = [arrays[0], np.zeros((8, 8), np.uint8), np.zeros((10, 10, 3), np.uint8), arrays[1], arrays[2]]
    out = segmenter({"image": column, "name": np.array(list("abcde"))}, points=[[12, 15]])
    assert list(out["name"]) == list("abcde")
    errors = list(out["error"])
    assert errors[0] is None and errors[3] is None and errors[4] is None
    assert "HxWx3 uint8" in errors[1] and "outside the image" in errors[2]
    assert out["masks"][1] is None and list(out["num_masks"]) == [1, 0, 0, 1, 1]
    alone = segmenter.segment([arrays[0], arrays[1], arrays[2]], points=[[12, 15]])
    for row, result in zip((0, 3, 4), alone, strict=True):
        assert out["masks"][row] == masks_json(result)
    files = segmenter({"path": np.array([str(paths[0]), str(paths[0].with_name("gone.png"))])}, points=[[12, 15]])
    assert_same_masks(json.loads(files["masks"][0]), json.loads(out["masks"][0]))  # batched otherwise: not bitwise
    assert "does not exist" in files["error"][1]
    everything = segmenter({"image": column[[0]]}, everything=True)
    assert everything["error"][0] is None and everything["num_masks"][0] > 0


def test_bad_arguments_and_inputs_are_clear(setup, tmp_path):
    checkpoint, paths, segmenter = setup
    cases = [
        (lambda: genfast.Segmenter("sam-vit-q"), "unknown SAM model 'sam-vit-q'"),
        (lambda: genfast.Segmenter(checkpoint=str(checkpoint), batch_size=0), "batch_size must be at least 1"),
        (lambda: genfast.Segmenter(checkpoint=str(checkpoint), recipe="warp-speed"), "invalid Segmenter argument"),
        (lambda: segmenter.segment(paths[0]), "no prompt given"),
        (lambda: segmenter.segment(paths[0], points=[[1, 2, 3]]), "--point expects X,Y"),
        (lambda: segmenter.segment(paths[0], points=[[1, 2]], labels=[1, 0]), "one label per point"),
        (lambda: segmenter.segment([paths[0], tmp_path / "missing.png"], points=[[1, 2]]), "image 1: image"),
        (lambda: segmenter.segment(paths[0], points=[[500, 2]]), "image 0: --point 500.0,2.0 is outside"),
        (lambda: segmenter({"name": np.array(["a"])}, points=[[1, 2]]), "no `image` or `path` column"),
    ]
    for call, message in cases:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.")):
            call()
