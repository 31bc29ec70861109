"""`genfast segment DIR_OR_GLOB -o OUTDIR`: each image's masks equal the one-image command's;
the encoder batch changes nothing; a re-run skips what is done; bad images are named and left
out while the others run; folders of numbered frames stay videos."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from genfast.cli import main
from genfast.errors import UserError
from genfast.sam.batch_command import image_paths, is_frame_folder
from genfast.sam.build import build_sam
from genfast.sam.sam2.build import build_random_sam2, to_official_keys
from tests.sam.oracle import randomize_
from tests.sam.test_cli import read_mask, rle_decode
from tests.sam.test_modeling import TINY

SIZES = [(50, 37), (40, 64), (64, 48), (33, 45), (48, 48)]  # (height, width): each image its own


def picture(height: int, width: int, seed: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(x * 255 // width + seed * 40) % 256, y * 255 // height, (x * y + seed) % 256], -1).astype(
        np.uint8
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batch_inputs")
    torch.manual_seed(0)
    model = build_sam(TINY)
    randomize_(model, scale=0.1)
    torch.save(model.state_dict(), root / "tiny.pth")
    sam2 = build_random_sam2("sam2.1-hiera-tiny", scale=0.05)
    torch.save({"model": to_official_keys(sam2.state_dict())}, root / "sam2.1_hiera_tiny.pt")
    photos = root / "photos"
    photos.mkdir()
    for i, (h, w) in enumerate(SIZES):
        Image.fromarray(picture(h, w, i)).save(photos / f"photo-{i}.{'png' if i % 2 else 'jpg'}")
    (photos / "readme.txt").write_text("not an image, not matched")
    return {"sam": root / "tiny.pth", "sam2": root / "sam2.1_hiera_tiny.pt", "photos": photos}


def segment(source: str | Path, checkpoint: Path, *args: str) -> int:
    return main(["segment", str(source), "--checkpoint", str(checkpoint), "--threads", "1", *args])


@pytest.mark.parametrize("model", ["sam", "sam2"])
def test_each_image_equals_the_one_image_command_in_a_batch(files, tmp_path, model, capsys):
    # SAM 2's tiny model is the real architecture at 1024x1024: three images keep it quick.
    count = 5 if model == "sam" else 3
    source = files["photos"] if model == "sam" else str(files["photos"] / "photo-[0-2].*")
    prompt = ["--point", "12,15", "--multimask"]
    assert segment(source, files[model], *prompt, "-o", str(tmp_path / "out"), "--batch-size", "3") == 0
    assert f"done {count}, skipped 0 (already in the output), failed 0" in capsys.readouterr().err
    for i, path in enumerate(sorted(files["photos"].glob("photo-*"))[:count]):
        alone = tmp_path / f"alone-{i}.png"
        assert segment(path, files[model], *prompt, "-o", str(alone), "--json", str(tmp_path / f"alone-{i}.json")) == 0
        want = json.loads((tmp_path / f"alone-{i}.json").read_text())
        got = json.loads((tmp_path / "out" / f"{path.stem}.json").read_text())
        assert got["image"] == str(path) and got["image_size"] == list(SIZES[i])
        assert [m["predicted_iou"] for m in got["masks"]] == pytest.approx(
            [m["predicted_iou"] for m in want["masks"]], rel=1e-4, abs=1e-5
        )
        for a, b in zip(got["masks"], want["masks"], strict=True):
            assert np.array_equal(rle_decode(a["segmentation"]), rle_decode(b["segmentation"]))
        assert np.array_equal(read_mask(tmp_path / "out" / f"{path.stem}.png"), read_mask(alone))
        for suffix in ("-2.png", "-3.png", "-overlay.png"):
            assert (tmp_path / "out" / f"{path.stem}{suffix}").is_file()


def test_a_glob_auto_and_a_rerun_that_skips_what_is_done(files, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--auto", "--points-per-side", "4", "--pred-iou-thresh", "0", "--no-overlay", "-o", str(out)]
    assert segment(str(files["photos"] / "*.png"), files["sam"], *args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["photo-1.json", "photo-1.png", "photo-3.json", "photo-3.png"]
    assert "done 2, skipped 0" in capsys.readouterr().err
    (out / "photo-3.png").unlink()  # one output of one image gone: that image is not redone without --force
    (out / ".photo-0.png.k3_x9abz.tmp").write_bytes(b"cut")  # what a run killed while writing leaves
    assert segment(str(files["photos"] / "*"), files["sam"], *args) == 1
    assert not (out / ".photo-0.png.k3_x9abz.tmp").exists()  # photo-0 was written again: its leftover is gone
    err = capsys.readouterr().err
    assert "photo-3.png: some of its outputs exist (photo-3.json): remove them or pass --force" in err
    assert "done 3, skipped 1 (already in the output), failed 1" in err
    before = (out / "photo-1.json").stat().st_mtime_ns
    assert segment(str(files["photos"] / "*"), files["sam"], *args, "--force") == 0
    assert "done 5, skipped 0" in capsys.readouterr().err
    assert (out / "photo-1.json").stat().st_mtime_ns > before


def test_bad_images_are_named_and_the_others_run(files, tmp_path, capsys):
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("a.png", "b.png"):
        Image.fromarray(picture(40, 40, 1)).save(photos / name)
    Image.fromarray(picture(10, 10, 2)).save(photos / "small.png")  # the point lies outside it
    (photos / "text.png").write_text("hello")  # not an image
    (photos / "cut.jpg").write_bytes((files["photos"] / "photo-0.jpg").read_bytes()[:200])  # truncated
    out = tmp_path / "out"
    assert segment(photos, files["sam"], "--point", "20,20", "-o", str(out), "--batch-size", "2") == 1
    err = capsys.readouterr().err
    assert "small.png: " in err and "outside" in err
    assert "text.png: " in err and "cut.jpg: " in err
    assert "done 2, skipped 0 (already in the output), failed 3" in err
    assert sorted(p.name for p in out.glob("*.json")) == ["a.json", "b.json"]


def test_flag_errors_write_nothing(files, tmp_path, capsys):
    photos = str(files["photos"])
    cases = [
        ([photos, "--point", "1,1"], "needs -o OUTDIR"),
        ([photos, "--point", "1,1", "-o", str(tmp_path / "o"), "--json", "x.json"], "--json names one file"),
        ([str(tmp_path / "*.png"), "--point", "1,1", "-o", str(tmp_path / "o")], "no images match"),
        ([str(files["photos"] / "photo-0.jpg"), "--images", "-o", str(tmp_path / "o")], "--images is for a folder"),
    ]
    for args, message in cases:
        assert main(["segment", *args, "--checkpoint", str(files["sam"])]) == 2
        assert message in capsys.readouterr().err
    same = tmp_path / "same"
    same.mkdir()
    for name in ("x.png", "x.jpg"):
        Image.fromarray(picture(20, 20, 0)).save(same / name)
    assert segment(same, files["sam"], "--point", "1,1", "-o", str(tmp_path / "o")) == 2
    assert "would write the same OUTDIR/x.png" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_numbered_frames_are_a_video_unless_images_is_given(tmp_path):
    frames, photos = tmp_path / "frames", tmp_path / "photos"
    frames.mkdir()
    photos.mkdir()
    for i in range(3):
        Image.fromarray(picture(16, 16, i)).save(frames / f"{i:05d}.jpg")
        Image.fromarray(picture(16, 16, i)).save(photos / f"IMG_{i}.jpg")
    assert is_frame_folder(frames) and not is_frame_folder(photos)
    assert [p.name for p in image_paths(str(frames))] == ["00000.jpg", "00001.jpg", "00002.jpg"]


def test_ray_refuses_a_video_before_joining_a_cluster(tmp_path, monkeypatch, capsys):
    import genfast.ray.sam

    def no_cluster(address):
        raise UserError("the cluster was joined")

    monkeypatch.setattr(genfast.ray.sam, "connect", no_cluster)
    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(3):
        Image.fromarray(picture(16, 16, i)).save(frames / f"{i:05d}.jpg")
    (tmp_path / "clip.mp4").write_bytes(b"")
    flags = ["--point", "1,1", "-o", str(tmp_path / "out"), "--ray"]
    for source in (frames, tmp_path / "clip.mp4"):
        assert main(["segment", str(source), *flags]) == 2
        err = capsys.readouterr().err
        assert "is a video" in err and "--ray does not apply; drop --ray" in err, err
    # --images makes the frames separate images, which --ray takes: on to the (here refused) cluster.
    assert main(["segment", str(frames), "--images", *flags]) == 2
    assert "the cluster was joined" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
