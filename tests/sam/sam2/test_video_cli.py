"""`genfast segment VIDEO` end to end through cli.main, on an mp4 written here and a SAM 2
checkpoint of the tiny test architecture (registered as a preset for the test, since checkpoints
are recognized by their shapes): the masks are the video predictor's, every output is written,
and user errors are one line with nothing overwritten."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from genfast.cli import main
from genfast.sam.sam2.build import build_random_sam2, load_sam2_checkpoint, to_official_keys
from genfast.sam.sam2.config import SAM2_PRESETS, tiny_sam2_config
from genfast.sam.sam2.video import SAM2VideoPredictor
from tests.sam.test_video_io import H, W, write_video

N = 12  # frames: a keyframe every 8, so decoding seeks


@pytest.fixture
def tiny_preset(monkeypatch):
    config = tiny_sam2_config()
    monkeypatch.setitem(SAM2_PRESETS, config.name, config)
    return config


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("video_cli")
    model = build_random_sam2(tiny_sam2_config(), seed=10, scale=0.1)
    torch.save({"model": to_official_keys(model.state_dict())}, root / "tiny.pt")
    write_video(root / "clip.mp4", n=N)
    (root / "broken.mp4").write_text("not a video")
    return {"checkpoint": root / "tiny.pt", "video": root / "clip.mp4", "broken": root / "broken.mp4"}


def segment(files: dict[str, Path], out: Path, *args: str) -> int:
    return main(["segment", str(files["video"]), "--checkpoint", str(files["checkpoint"]), "-o", str(out), *args])


def _expected(files: dict[str, Path], prompts: list[tuple[int, int, list[float]]]) -> dict[int, dict[int, np.ndarray]]:
    """What the video predictor gives for (frame, object, point) clicks, forwards from the first
    prompted frame, then backwards: frame -> object -> bool mask."""
    predictor = SAM2VideoPredictor(load_sam2_checkpoint(files["checkpoint"]))
    state = predictor.init_state(str(files["video"]))
    for frame, obj, point in prompts:
        predictor.add_new_points_or_box(state, frame, obj, points=np.array([point]), labels=np.array([1]))
    first = min(frame for frame, _, _ in prompts)
    masks: dict[int, dict[int, np.ndarray]] = {}
    for reverse in (False, True):
        for frame, ids, logits in predictor.propagate_in_video(state, start_frame_idx=first, reverse=reverse):
            masks.setdefault(frame, {i: logits[k, 0].numpy() > 0 for k, i in enumerate(ids)})
    return masks


def _read_png(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image) > 0


def test_two_objects_tracked_from_a_middle_frame(files, tiny_preset, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    args = ["--point", "20,30", "--point", "50,20", "--object", "1", "--object", "2", "--frame", "3"]
    assert segment(files, out, *args) == 0
    err = capsys.readouterr().err
    assert f"frames {N}/{N}" in err and "frames/s" in err
    expected = _expected(files, [(3, 1, [20.0, 30.0]), (3, 2, [50.0, 20.0])])
    document = json.loads((out / "masks.json").read_text())
    assert document["object_ids"] == [1, 2]
    assert [f["frame"] for f in document["frames"]] == list(range(N))
    for frame in range(N):
        for obj in (1, 2):
            png = out / "masks" / f"obj{obj}" / f"{frame:05d}.png"
            assert np.array_equal(_read_png(png), expected[frame][obj]), (frame, obj)
    with av.open(str(out / "overlay.mp4")) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == N and (frames[0].height, frames[0].width) == (H, W)


def test_outputs_are_not_overwritten(files, tiny_preset, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert segment(files, out, "--point", "40,30", "--no-overlay") == 0
    before = (out / "masks.json").read_bytes()
    capsys.readouterr()
    assert segment(files, out, "--point", "50,30", "--no-overlay") != 0
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (out / "masks.json").read_bytes() == before
    assert segment(files, out, "--point", "50,30", "--no-overlay", "--force") == 0
    assert not (out / "overlay.mp4").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--point", "40,30", "--frame", "99"], f"--frame 99 is out of range: the video has {N} frames (0 to {N - 1})"),
        (["--point", "400,30"], "--point 400,30 is outside the frame"),
        (["--point", "1,2", "--point", "3,4", "--object", "1", "--object", "2", "--object", "3"], "got 3 --object"),
        (["--auto"], "--auto segments one image"),
        ([], "no prompt given"),
    ],
)
def test_user_errors(files, tiny_preset, tmp_path, capsys, args: list[str], message: str) -> None:
    out = tmp_path / "out"
    assert segment(files, out, *args) != 0
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_unreadable_video_and_sam1_model(files, tiny_preset, tmp_path, capsys) -> None:
    from genfast.sam.build import build_sam
    from tests.sam.test_modeling import TINY

    out = tmp_path / "out"
    assert main(["segment", str(files["broken"]), "--point", "1,1", "-o", str(out)]) != 0
    assert "as a video" in capsys.readouterr().err
    sam1 = tmp_path / "sam1.pth"
    torch.save(build_sam(TINY).state_dict(), sam1)
    assert main(["segment", str(files["video"]), "--checkpoint", str(sam1), "--point", "1,1", "-o", str(out)]) != 0
    assert "videos need SAM 2" in capsys.readouterr().err
