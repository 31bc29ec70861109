"""`genfast bench sam` with a SAM 2 model, end to end on the tiny test architecture (each row in its
own process), against the official package's rows."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

from genfast import cli
from genfast.sam.sam2.bench import VideoFrame, masks_found, video_agreement
from genfast.sam.sam2.config import tiny_sam2_config


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny-sam2.json"
    path.write_text(json.dumps(asdict(tiny_sam2_config())))
    return path


def test_image_rows_against_the_official_package(tiny_config, tmp_path, capsys):
    out = tmp_path / "rows.json"
    ladder = "--steps official,baseline,bf16,sdpa --dtype bfloat16 --repeats 1 --batch-size 1"
    assert cli.main(["bench", "sam", "--config", str(tiny_config), *ladder.split(), "--json", str(out)]) == 0
    rows = {row["step"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["official", "baseline", "bf16", "sdpa"]
    for row in rows.values():
        assert row["kind"] == "image" and row["img_s"] > 0 and row["peak_mem_gb"] > 0
    assert rows["official"]["speedup"] == 1.0
    # genfast's fp32 computes what the official package computes; bf16 within the step's budget.
    assert rows["baseline"]["mask_iou"] >= 0.999 and rows["baseline"]["logit_rel_err"] < 1e-4
    assert rows["sdpa"]["mask_iou"] >= 0.9
    assert "| official | 1 |" in capsys.readouterr().out


def test_automatic_rows_against_the_official_generator(tiny_config, tmp_path):
    out = tmp_path / "rows.json"
    grid = "--automatic --all-masks --points-per-side 3 --points-per-batch 4"
    ladder = "--steps official,baseline --repeats 1 --batch-size 1"
    code = cli.main(["bench", "sam", "--config", str(tiny_config), *grid.split(), *ladder.split(), "--json", str(out)])
    assert code == 0
    rows = {row["step"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["official", "baseline"]
    assert all(row["kind"] == "automatic" and row["img_s"] > 0 and row["masks"] >= 1 for row in rows.values())
    assert rows["baseline"]["mask_iou"] >= 0.999


def test_a_config_that_is_not_sam2_goes_to_sam(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stages": [1, 2], "unknown": 3}))
    assert cli.main(["bench", "sam", "--config", str(bad)]) != 0
    assert "is not a SAM 2 config" in capsys.readouterr().err


def test_video_rows_against_the_official_predictor(tiny_config, tmp_path, capsys):
    out = tmp_path / "rows.json"
    ladder = "--video --frames 4 --steps official,baseline,bf16 --dtype bfloat16 --repeats 1"
    assert cli.main(["bench", "sam", "--config", str(tiny_config), *ladder.split(), "--json", str(out)]) == 0
    rows = {row["step"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["official", "baseline", "bf16"]
    for row in rows.values():
        assert row["kind"] == "video" and row["frames"] == 4 and row["frames_s"] > 0
        assert "mem_growth_mb_per_frame" in row and 0.0 <= row["masks_found"] <= 1.0
    # The IoU means something only where masks were found: this config finds both objects.
    assert rows["official"]["masks_found"] > 0.5
    # genfast's fp32 tracks as the official package does; the baseline's explicit softmax rounds
    # unlike the official's SDPA, and the memory carries a few flipped edge pixels to later frames.
    assert rows["baseline"]["mask_iou"] >= 0.99 and rows["baseline"]["logit_rel_err"] < 1e-3
    assert rows["bf16"]["mask_iou"] >= 0.9 and rows["bf16"]["logit_rel_err"] < 0.1
    assert "MB/frame" in capsys.readouterr().out


def _frame(masks: list[list[int]]) -> VideoFrame:
    """One frame of objects' 1 x 8 masks (a pixel per entry), the logits +-1 where a mask is on/off."""
    bits = np.array(masks, dtype=bool)[:, None, :]
    return np.packbits(bits, axis=-1), np.where(bits, 1.0, -1.0).astype(np.float16)


def test_video_agreement_leaves_out_pairs_where_neither_found_a_mask():
    ours = [_frame([[1, 1, 0, 0, 0, 0, 0, 0], [0] * 8])]
    ref = [_frame([[1, 0, 0, 0, 0, 0, 0, 0], [0] * 8])]
    figures = video_agreement(ours, ref)
    assert figures["mask_iou"] == 0.5  # the second object, empty in both, is not a perfect 1.0
    assert figures["logit_rel_err"] == pytest.approx(2 / 4)  # one logit of 16 off by 2; the norm is 4
    assert masks_found(ours) == 0.5
    empty = [_frame([[0] * 8, [0] * 8])]
    assert "mask_iou" not in video_agreement(empty, empty) and masks_found(empty) == 0.0


def test_video_needs_sam2(capsys):
    assert cli.main(["bench", "sam", "--model", "vit_b", "--video"]) != 0
    assert "--video tracks with SAM 2" in capsys.readouterr().err
