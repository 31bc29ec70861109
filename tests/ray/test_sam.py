"""genfast.ray.sam on a two-node Ray cluster: `genfast segment DIR -o OUT --ray` writes the files
the single-process command writes (the same masks, overlays and JSON; the bad images named; done
images skipped, by a re-run too) and loses no image when a worker is killed midway (its rows run
again); the plain Ray Data pipeline gives each image's row the masks `genfast.Segmenter` gives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from genfast import cli
from genfast.sam.build import build_sam
from genfast.sam.segmenter import Segmenter, masks_json
from tests.ray.workers import run_driver, run_killing_a_worker
from tests.sam.oracle import randomize_
from tests.sam.test_batch_command import SIZES, picture
from tests.sam.test_modeling import TINY


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = build_sam(TINY)
    randomize_(model, scale=0.1)
    path = tmp_path_factory.mktemp("tiny-sam") / "tiny.pth"
    torch.save(model.state_dict(), path)
    return path


def photos_with_bad_ones(folder: Path) -> Path:
    """SIZES' pictures, one too small for the point (20, 25) and one that is not an image."""
    folder.mkdir()
    for i, (h, w) in enumerate(SIZES):
        Image.fromarray(picture(h, w, i)).save(folder / f"photo-{i}.png")
    Image.fromarray(picture(10, 10, 9)).save(folder / "small.png")  # the point lies outside it
    (folder / "text.png").write_text("not an image")
    return folder


def contents(folder: Path) -> dict[str, object]:
    """A folder's files: PNGs as (pixels, metadata), JSON documents parsed."""
    found: dict[str, object] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".png":
            with Image.open(path) as img:
                found[path.name] = (np.asarray(img), dict(img.text))
        else:
            found[path.name] = json.loads(path.read_text())
    return found


def assert_same_outputs(got: dict[str, object], want: dict[str, object]) -> None:
    assert sorted(got) == sorted(want)
    for name, expected in want.items():
        if name.endswith(".png"):
            assert np.array_equal(got[name][0], expected[0]) and got[name][1] == expected[1], name
            continue
        masks, expected_masks = got[name].pop("masks"), expected.pop("masks")
        assert got[name] == expected, name
        for mask, expected_mask in zip(masks, expected_masks, strict=True):
            assert mask.pop("predicted_iou") == pytest.approx(expected_mask.pop("predicted_iou"), rel=1e-4, abs=1e-5)
            assert mask == expected_mask, name  # the RLE, area, box, rank and file


def segment_on_ray(address: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "genfast", "segment", *args, "--ray", address, "--actors", "2"]
    # The worktree on the path: the subprocess may run in another folder.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def test_the_outputs_are_the_single_process_ones_and_a_rerun_skips_them(
    ray_cluster, checkpoint, tmp_path, monkeypatch, capsys
):
    # Relative paths, as a user types them: the actors run elsewhere, the files name them as given.
    shutil.copy(checkpoint, tmp_path / "tiny.pth")
    photos_with_bad_ones(tmp_path / "photos")
    monkeypatch.chdir(tmp_path)
    args = ["photos", "--checkpoint", "tiny.pth", "--point", "20,25", "--multimask", "-o", "out", "--batch-size", "2"]
    assert cli.main(["segment", *args, "--threads", "1"]) == 1  # the bad images
    capsys.readouterr()
    (tmp_path / "out").rename(tmp_path / "alone")
    (tmp_path / "out").mkdir()
    for done_before in (tmp_path / "alone").glob("photo-4*"):  # skipped
        shutil.copy(done_before, tmp_path / "out" / done_before.name)
    (tmp_path / "out" / ".photo-0.json.k3j5x9aa.tmp").write_text("{")  # left by a killed run: removed
    done = segment_on_ray(ray_cluster, *args, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    bad = [line for line in done.stderr.splitlines() if line.startswith("genfast: skipped photos/")]
    assert len(bad) == 2, done.stderr
    assert "photos/small.png: --point 20.0,25.0 is outside the image" in bad[0] + bad[1]
    assert "photos/text.png: cannot read" in bad[0] + bad[1]
    assert "done 4, skipped 1 (already in the output), failed 2 on Ray" in done.stderr
    want = contents(tmp_path / "alone")
    assert len(want) == 5 * 5  # three masks, the overlay and the JSON of each good image
    assert_same_outputs(contents(tmp_path / "out"), want)
    for bad_image in ("small.png", "text.png"):
        (tmp_path / "photos" / bad_image).unlink()
    again = segment_on_ray(ray_cluster, *args, cwd=tmp_path)
    assert again.returncode == 0 and "done 0, skipped 5 (already in the output), failed 0" in again.stderr, again.stderr


def test_the_ray_data_pipeline_writes_a_row_per_image(ray_cluster, checkpoint, tmp_path):
    photos, out = photos_with_bad_ones(tmp_path / "photos"), tmp_path / "rows"
    arguments = {"checkpoint": str(checkpoint), "threads": 1, "batch_size": 2}
    script = (
        "import glob; from genfast.ray.sam import segment_images; "
        f"print(segment_images(sorted(glob.glob({str(photos / '*')!r})), {str(out)!r}, {arguments!r}, "
        f"prompt={{'points': [[20, 25]]}}, address={ray_cluster!r}, concurrency=2, batch_size=2))"
    )
    assert run_driver(script) == str(len(SIZES) + 2)
    by_name = rows_of(out)
    assert len(by_name) == len(SIZES) + 2
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


def rows_of(folder: Path) -> dict[str, dict]:
    rows = [json.loads(line) for f in folder.glob("*.json") for line in f.read_text().splitlines() if line]
    by_name = {Path(r["path"]).name: r for r in rows}
    assert len(by_name) == len(rows), "an image was written twice"
    return by_name


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds Ray's worker processes in /proc")
def test_a_killed_worker_loses_no_image(ray_cluster, checkpoint, tmp_path):
    photos, out = tmp_path / "photos", tmp_path / "out"
    photos.mkdir()
    n = 48
    for i in range(n):
        Image.fromarray(picture(40 + i % 7, 48, i)).save(photos / f"photo-{i:02d}.png")
    args = [str(photos), "--checkpoint", str(checkpoint), "--point", "20,25", "-o", str(out), "--batch-size", "2"]
    command = [sys.executable, "-m", "genfast", "segment", *args, "--ray", ray_cluster, "--actors", "2"]
    documents = lambda: list(out.glob("*.json"))  # noqa: E731
    status, err, written_before = run_killing_a_worker(
        command, "FileSegmenter", lambda: bool(documents()), lambda: len(documents())
    )
    assert status == 0, err
    assert written_before < n  # the kill came before the end
    assert f"done {n}, skipped 0" in err
    names = [f"photo-{i:02d}{suffix}" for i in range(n) for suffix in (".json", ".png", "-overlay.png")]
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # each once, no temporaries
    picked = [photos / f"photo-{i:02d}.png" for i in (0, n // 2, n - 1)]
    want = Segmenter(checkpoint=str(checkpoint), threads=1).segment(picked, points=[[20, 25]])
    for path, result in zip(picked, want, strict=True):
        with Image.open(out / path.name) as mask:
            assert np.array_equal(np.asarray(mask) == 255, result.masks[0]), path.name
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and f"done 0, skipped {n} (already in the output)" in rerun.stderr, rerun.stderr
