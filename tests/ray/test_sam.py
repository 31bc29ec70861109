"""genfast.ray.sam on a two-node Ray cluster: `genfast segment DIR -o OUT --ray` gives each image
the masks the single-process `genfast.Segmenter` gives it, and names the images it could not
segment (unreadable, the prompt outside) while the others run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from genfast.sam.build import build_sam
from genfast.sam.segmenter import Segmenter, masks_json
from tests.sam.oracle import randomize_
from tests.sam.test_batch_command import SIZES, picture
from tests.sam.test_modeling import TINY


def test_rows_equal_the_single_process_masks(ray_cluster, tmp_path):
    torch.manual_seed(0)
    model = build_sam(TINY)
    randomize_(model, scale=0.1)
    checkpoint = tmp_path / "tiny.pth"
    torch.save(model.state_dict(), checkpoint)
    photos = tmp_path / "photos"
    photos.mkdir()
    for i, (h, w) in enumerate(SIZES):
        Image.fromarray(picture(h, w, i)).save(photos / f"photo-{i}.png")
    Image.fromarray(picture(10, 10, 9)).save(photos / "small.png")  # the point lies outside it
    (photos / "text.png").write_text("not an image")
    command = [sys.executable, "-m", "genfast", "segment", str(photos), "--checkpoint", str(checkpoint),
               "--point", "20,25", "-o", str(tmp_path / "out"), "--ray", ray_cluster, "--actors", "2",
               "--batch-size", "2"]  # fmt: skip
    process = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr
    rows = [json.loads(line) for f in (tmp_path / "out").glob("*.json") for line in f.read_text().splitlines()]
    by_name = {Path(r["path"]).name: r for r in rows}
    assert len(rows) == len(by_name) == len(SIZES) + 2
    assert "outside the image" in by_name["small.png"]["error"] and by_name["small.png"]["masks"] is None
    assert "cannot read" in by_name["text.png"]["error"]
    segmenter = Segmenter(checkpoint=str(checkpoint), threads=1)
    want = segmenter.segment(sorted(photos.glob("photo-*.png")), points=[[20, 25]])
    for i, result in enumerate(want):
        row = by_name[f"photo-{i}.png"]
        assert row["error"] is None and row["num_masks"] == 1
        got, expected = json.loads(row["masks"]), json.loads(masks_json(result))
        assert got[0]["segmentation"] == expected[0]["segmentation"]
        assert np.isclose(got[0]["predicted_iou"], expected[0]["predicted_iou"], rtol=1e-4, atol=1e-5)
