"""`genfast.Segmenter.track`: SAM 2 video tracking from Python gives the masks `genfast segment
VIDEO` writes for the same clip and prompts (several objects, prompts on later frames), and the
video predictor's for a folder of frames; a SAM (1) model and bad inputs are refused clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import genfast
from genfast.cli import main
from genfast.errors import UserError
from genfast.sam.sam2.build import build_random_sam2, load_sam2_checkpoint, to_official_keys
from genfast.sam.sam2.config import SAM2_PRESETS, tiny_sam2_config
from genfast.sam.sam2.video import SAM2VideoPredictor
from tests.sam.test_video_io import make_frame, write_video

N = 10  # frames: a keyframe every 8, so decoding seeks


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("segmenter_video")
    model = build_random_sam2(tiny_sam2_config(), seed=12, scale=0.1)  # masks neither empty nor whole frames
    torch.save({"model": to_official_keys(model.state_dict())}, root / "tiny.pt")
    write_video(root / "clip.mp4", n=N)
    (root / "frames").mkdir()
    for i in range(N):
        Image.fromarray(make_frame(i)).save(root / "frames" / f"{i}.png")
    return {"checkpoint": root / "tiny.pt", "video": root / "clip.mp4", "frames": root / "frames"}


@pytest.fixture
def segmenter(files, monkeypatch) -> genfast.Segmenter:
    config = tiny_sam2_config()  # checkpoints are recognized by their shapes: the tiny one as a preset
    monkeypatch.setitem(SAM2_PRESETS, config.name, config)
    return genfast.Segmenter(checkpoint=str(files["checkpoint"]), threads=1)


def _read_png(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image) > 0


def _partial(tracked: list[dict[int, np.ndarray]]) -> bool:
    """Whether some object's mask covers part of a frame: masks that can differ (not all empty)."""
    return any(0 < mask.sum() < mask.size for masks in tracked for mask in masks.values())


def test_two_objects_prompted_on_later_frames_equal_the_command(segmenter, files, tmp_path) -> None:
    # Object 1: a point on frame 3; object 2: a box on frame 5 (tracked both ways from frame 3).
    tracked = segmenter.track(
        files["video"], points=[[20, 30]], boxes=[[40, 10, 60, 30]], object_id=[1, 2], frame=[3, 5]
    )
    out = tmp_path / "out"
    args = ["--point", "20,30", "--box", "40,10,60,30", "--object", "1", "--object", "2", "--frame", "3"]
    args += ["--frame", "5", "--no-overlay", "--threads", "1"]
    command = ["segment", str(files["video"]), "--checkpoint", str(files["checkpoint"]), "-o", str(out), *args]
    assert main(command) == 0
    assert len(tracked) == N
    for frame in range(N):
        assert sorted(tracked[frame]) == [1, 2], frame
        for obj in (1, 2):
            mask = tracked[frame][obj]
            assert mask.dtype == bool and mask.shape == (48, 64)
            assert np.array_equal(mask, _read_png(out / "masks" / f"obj{obj}" / f"{frame:05d}.png")), (frame, obj)
    assert _partial(tracked)


def test_a_folder_of_frames_equals_the_video_predictor(segmenter, files) -> None:
    tracked = segmenter.track(str(files["frames"]), points=[[12, 28], [40, 5]], labels=[1, 0])
    predictor = SAM2VideoPredictor(load_sam2_checkpoint(files["checkpoint"]))
    state = predictor.init_state(str(files["frames"]))
    predictor.add_new_points_or_box(state, 0, 1, points=np.array([[12, 28], [40, 5]]), labels=np.array([1, 0]))
    frames = list(predictor.propagate_in_video(state))
    assert [frame for frame, _, _ in frames] == list(range(N))
    for frame, ids, logits in frames:
        assert list(tracked[frame]) == list(ids) == [1]
        assert np.array_equal(tracked[frame][1], logits[0, 0].numpy() > 0), frame
    assert _partial(tracked)


def test_a_sam1_model_is_refused(files, tmp_path) -> None:
    from genfast.sam.build import build_sam
    from tests.sam.test_modeling import TINY

    torch.save(build_sam(TINY).state_dict(), tmp_path / "sam1.pth")
    sam1 = genfast.Segmenter(checkpoint=str(tmp_path / "sam1.pth"), threads=1)
    with pytest.raises(UserError, match=r"SAM \(1\) model: videos need SAM 2 \(e.g. Segmenter\('sam2.1-hiera-tiny'\)"):
        sam1.track(files["video"], points=[[20, 30]])


@pytest.mark.parametrize(
    ("video", "prompt", "message"),
    [
        ("missing.mp4", {"points": [[20, 30]]}, "does not exist"),
        ("clip.mp4", {"points": [[20, 30]], "frame": 99}, f"--frame 99 is out of range: the video has {N} frames"),
        ("clip.mp4", {"points": [[400, 30]]}, "is outside the frame (the video is 64x48 pixels"),
        ("clip.mp4", {"boxes": [[40, 30, 10, 50]]}, "with X0 < X1 and Y0 < Y1"),
        ("clip.mp4", {"points": [[1, 2], [3, 4]], "object_id": [1, 2, 3]}, "got 3 --object for 2 prompts"),
        ("clip.mp4", {"points": [[1, 2]], "frame": -1}, "--frame takes a whole number >= 0, got '-1'"),
        ("clip.mp4", {}, "no prompt given"),
    ],
)
def test_bad_inputs_are_refused(segmenter, files, video: str, prompt: dict, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        segmenter.track(files["video"].with_name(video), **prompt)
