"""genfast.sam.video_io: frames read from tiny videos made here with PyAV (each frame's index is in
its pixels: a gray level and a square's position) and folders of frames made with PIL; the mask
PNGs, RLE JSON and overlay video read back."""

from __future__ import annotations

import json
import random
import wave
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from genfast.errors import UserError
from genfast.sam import images, video_io
from genfast.sam.masks import rle_to_mask
from genfast.sam.video_io import (
    MaskPngWriter,
    MaskStore,
    OverlayVideoWriter,
    VideoOutputPaths,
    VideoResultWriter,
    open_video,
)

N, H, W, FPS, GOP = 32, 48, 64, 24, 8
SQUARE = 8


def level(i: int) -> int:
    """Frame i's background gray level: distinct frames, far apart for a lossy codec."""
    return 20 + 6 * i


def square_x(i: int) -> int:
    return i  # the square moves one pixel a frame, left to right


def make_frame(i: int, height: int = H, width: int = W) -> np.ndarray:
    frame = np.full((height, width, 3), level(i), dtype=np.uint8)
    frame[24 : 24 + SQUARE, square_x(i) : square_x(i) + SQUARE] = 255
    return frame


def write_video(path: Path, n: int = N, fmt: str | None = None, rotation: int = 0) -> Path:
    """H.264 with B-frames and a keyframe every GOP frames (so seeking matters)."""
    container = av.open(str(path), "w", format=fmt)
    stream = container.add_stream("libx264", rate=FPS, options={"bf": "2", "crf": "10"})
    stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
    stream.codec_context.gop_size = GOP
    if rotation:
        stream.set_display_rotation(rotation)
    for i in range(n):
        for packet in stream.encode(av.VideoFrame.from_ndarray(make_frame(i), format="rgb24")):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    return path


def check_frame(frame: np.ndarray, i: int) -> None:
    assert frame.shape == (H, W, 3) and frame.dtype == np.uint8
    assert abs(float(frame[:16].mean()) - level(i)) < 3, f"frame {i}: gray {frame[:16].mean():.1f}"
    band = frame[24 : 24 + SQUARE].mean(axis=(0, 2))  # the square's rows: where is it?
    assert abs(int(np.argmax(band > (255 + level(i)) / 2)) - square_x(i)) <= 1, f"frame {i}: square misplaced"


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, Path]:
    """The test video in MP4 (a frame count in its header), Matroska (none), MPEG-TS (seeks by an
    estimate) and raw H.264 (no timestamps at all)."""
    folder = tmp_path_factory.mktemp("videos")
    return {
        "mp4": write_video(folder / "clip.mp4"),
        "mkv": write_video(folder / "clip.mkv"),
        "ts": write_video(folder / "clip.ts"),
        "h264": write_video(folder / "clip.h264", fmt="h264"),
    }


@pytest.fixture
def mp4(videos) -> Path:
    return videos["mp4"]


# ---- reading a video file ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mp4", "mkv", "ts", "h264"])
def test_count_size_fps_and_random_access(videos, kind):
    with open_video(videos[kind]) as video:
        assert (video.num_frames, len(video), video.height, video.width) == (N, N, H, W)
        if kind != "h264":  # a raw stream's rate is FFmpeg's guess
            assert video.fps == FPS
        order = list(range(N))
        random.Random(0).shuffle(order)
        for i in order + order[::-1]:
            check_frame(video.frame(i), i)


def test_frame_count_is_exact_without_a_header_count(videos):
    with av.open(str(videos["mkv"])) as container:
        assert container.streams.video[0].frames == 0  # Matroska has none: the packets are counted
    with av.open(str(videos["mp4"])) as container:
        assert container.streams.video[0].frames == N
    assert open_video(videos["mkv"]).num_frames == N


@pytest.mark.parametrize("kind", ["mp4", "ts"])
def test_reverse_iteration_decodes_each_frame_about_once(videos, kind):
    with open_video(videos[kind]) as video:
        seen = []
        for i, frame in video.frames(reverse=True):
            check_frame(frame, i)
            seen.append(i)
        assert seen == list(range(N - 1, -1, -1))
        # A group of pictures is decoded at a time and cached: linear, not N^2 / 2.
        assert video.decoded_frames <= N + 2 * GOP


def test_forward_iteration_and_ranges(mp4):
    with open_video(mp4) as video:
        assert [i for i, _ in video.frames(5, 12)] == list(range(5, 12))
        assert [i for i, _ in video.frames(5, 12, reverse=True)] == list(range(11, 4, -1))
        assert [i for i, _ in video.frames(7, 7)] == []
        for i, frame in enumerate(video):
            check_frame(frame, i)
        assert video.decoded_frames <= N + GOP  # forward: the decoder runs on, no seeks


def test_the_cache_is_bounded_in_bytes(mp4):
    with open_video(mp4, cache_bytes=3 * H * W * 3) as video:
        assert video.cache_capacity == 3
        order = list(range(N)) + list(range(N - 1, -1, -1))
        random.Random(1).shuffle(order)
        for i in list(range(N)) + list(range(N - 1, -1, -1)) + order:
            check_frame(video.frame(i), i)
            assert len(video.cached_indices()) <= 3
            assert video.cached_bytes() == len(video.cached_indices()) * H * W * 3
        assert video.cached_indices()[-1] == order[-1]  # the latest frame is the most recently used


def test_display_rotation_is_applied(tmp_path):
    with open_video(write_video(tmp_path / "phone.mp4", n=4, rotation=90)) as video:
        assert (video.height, video.width) == (W, H)
        rotated = np.rot90(make_frame(2))  # 90 degrees counterclockwise, as players show it
        assert np.abs(video.frame(2).astype(int) - rotated).mean() < 3


# ---- reading a folder of frames ----------------------------------------------------------------


def test_folder_frames_are_ordered_by_number(tmp_path):
    for number, i in [(10, 2), (1, 0), (2, 1)]:  # 1.jpg, 2.jpg, 10.jpg: 10 after 2
        Image.fromarray(make_frame(i)).save(tmp_path / f"{number}.jpg", quality=95)
    (tmp_path / "._1.jpg").write_bytes(b"AppleDouble junk")  # hidden: ignored
    (tmp_path / "notes.txt").write_text("not a frame")
    with open_video(tmp_path) as video:
        assert (video.num_frames, video.height, video.width, video.fps) == (3, H, W, None)
        assert [p.name for p in video.files] == ["1.jpg", "2.jpg", "10.jpg"]
        for i, frame in video.frames(reverse=True):
            check_frame(frame, i)


def test_folder_frames_are_ordered_by_name_unless_all_numbered(tmp_path):
    names = ["frame_b.png", "frame_a.jpeg", "10.jpg"]
    for name in names:
        Image.fromarray(make_frame(0)).save(tmp_path / name)
    with open_video(tmp_path) as video:
        assert [p.name for p in video.files] == sorted(names)


def test_folder_frames_must_share_one_size(tmp_path):
    Image.fromarray(make_frame(0)).save(tmp_path / "0.png")
    Image.fromarray(make_frame(1, H, W + 2)).save(tmp_path / "1.png")
    video = open_video(tmp_path)
    with pytest.raises(UserError, match=r"1\.png is 66x48 but the first frame, 0\.png, is 64x48"):
        video.frame(1)


# ---- errors ------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        open_video(tmp_path / "nope.mp4")


def test_a_text_file_named_mp4(tmp_path):
    fake = tmp_path / "fake.mp4"
    fake.write_text("this is not a video\n" * 20)
    with pytest.raises(UserError, match=r"cannot read .*fake\.mp4.* as a video"):
        open_video(fake)


def test_a_truncated_video(tmp_path):
    """Its index (at the front) promises frames its data no longer holds."""
    path = tmp_path / "noise.mp4"
    container = av.open(str(path), "w", options={"movflags": "+faststart"})
    stream = container.add_stream("libx264", rate=FPS, options={"crf": "0"})
    stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
    rng = np.random.default_rng(0)
    for _ in range(N):  # noise: every frame is large, so the cut falls in the middle of them
        frame = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
        for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    cut = tmp_path / "cut.mp4"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"cut\.mp4' is truncated: it holds only 1\d of its 32 frames whole;"):
        open_video(cut)
    cut.write_bytes(data[:200])
    with pytest.raises(UserError, match=r"cannot read .*cut\.mp4.* as a video"):
        open_video(cut)


def test_an_audio_file(tmp_path):
    path = tmp_path / "tone.wav"
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(8000)
        f.writeframes(np.zeros(800, dtype=np.int16).tobytes())
    with pytest.raises(UserError, match="has no video stream, only audio"):
        open_video(path)


def test_an_empty_folder(tmp_path):
    with pytest.raises(UserError, match="is empty"):
        open_video(tmp_path)


def test_a_folder_without_frames(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    (tmp_path / "clip.gif").write_bytes(b"GIF89a")
    with pytest.raises(UserError, match=r"has no \.jpg, \.jpeg or \.png frames \(it holds clip\.gif, readme\.txt\)"):
        open_video(tmp_path)


def test_frame_index_out_of_range(mp4):
    with open_video(mp4) as video:
        for bad in (N, -1):
            with pytest.raises(UserError, match=rf"frame {bad} is out of range: .* has 32 frames, numbered 0 to 31"):
                video.frame(bad)
        with pytest.raises(UserError, match="give 0 <= start <= stop <= 32"):
            list(video.frames(3, N + 1))


# ---- writing -----------------------------------------------------------------------------------


def object_masks(i: int, height: int = H, width: int = W) -> dict[int, np.ndarray]:
    """Object 1: the moving square; object 7: a fixed block (absent in odd frames)."""
    square = np.zeros((height, width), dtype=bool)
    square[24 : 24 + SQUARE, square_x(i) : square_x(i) + SQUARE] = True
    block = np.zeros((height, width), dtype=bool)
    if i % 2 == 0:
        block[2:10, 40:60] = True
    return {1: square, 7: block}


def test_results_round_trip(tmp_path, mp4):
    out = tmp_path / "out"  # created by the writer
    video = open_video(mp4)
    paths = VideoOutputPaths.in_directory(out)
    # SAM 2's order: forward from a prompt frame, then backward from it (given twice).
    order = list(range(10, N)) + list(range(10, -1, -1))
    with VideoResultWriter(video, paths, header={"model": "test"}) as writer:
        for i in order:
            masks = object_masks(i)
            masks[7] = masks[7].astype(np.float32) * 20 - 10  # logits are thresholded at 0
            writer.add(i, masks)

    for i in range(N):
        for object_id, mask in object_masks(i).items():
            png = np.asarray(Image.open(out / "masks" / f"obj{object_id}" / f"{i:05d}.png"))
            assert png.dtype == np.uint8 and set(np.unique(png)) <= {0, 255}
            assert np.array_equal(png == 255, mask)

    document = json.loads((out / "masks.json").read_text())
    assert document["model"] == "test" and document["object_ids"] == [1, 7]
    assert document["video"] == {"path": str(mp4), "num_frames": N, "height": H, "width": W, "fps": FPS}
    assert document["mask_files"] == str(out / "masks" / "obj{object_id}" / "{frame:05d}.png")
    assert [f["frame"] for f in document["frames"]] == list(range(N))  # sorted, each once
    for entry in document["frames"]:
        expected = object_masks(entry["frame"])
        assert [m["object_id"] for m in entry["masks"]] == [1, 7]
        for record in entry["masks"]:
            mask = expected[record["object_id"]]
            assert np.array_equal(rle_to_mask(record["segmentation"]).numpy(), mask)
            assert record["area"] == int(mask.sum())
        x, y = square_x(entry["frame"]), 24
        assert entry["masks"][0]["bbox"] == [x, y, SQUARE - 1, SQUARE - 1]  # XYWH, inclusive corners

    with av.open(str(out / "overlay.mp4")) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name in ("h264", "mpeg4")
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(frames) == N and frames[0].shape == (H, W, 3)
    blue = np.asarray(images.colour(0), dtype=float)  # object 1's colour, the first
    inside = frames[5][26:30, square_x(5) + 2 : square_x(5) + 6].reshape(-1, 3).mean(0)
    expected = (1 - images.OVERLAY_ALPHA) * 255 + images.OVERLAY_ALPHA * blue
    assert np.abs(inside - expected).max() < 12
    check_frame(np.where(object_masks(5)[1][..., None], make_frame(5), frames[5]), 5)  # untinted elsewhere
    assert sorted(p.name for p in out.iterdir()) == ["masks", "masks.json", "overlay.mp4"]  # no temp files left


def test_overlay_of_odd_sized_frames_is_padded_to_even(tmp_path):
    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(3):
        Image.fromarray(make_frame(i, 47, 63)).save(frames / f"{i:05d}.png")
    video = open_video(frames)
    with VideoResultWriter(video, VideoOutputPaths(None, None, tmp_path / "o.mp4")) as writer:
        writer.add(1, object_masks(1, 47, 63))
    with av.open(str(tmp_path / "o.mp4")) as container:
        stream = container.streams.video[0]
        assert (stream.height, stream.width, stream.codec_context.pix_fmt) == (48, 64, "yuv420p")
        assert float(stream.average_rate) == 30.0  # a folder has no rate: the default
        assert sum(1 for _ in container.decode(stream)) == 3


def test_outputs_are_not_overwritten_without_force(tmp_path, mp4):
    video = open_video(mp4)
    paths = VideoOutputPaths.in_directory(tmp_path)
    with VideoResultWriter(video, paths) as writer:
        writer.add(0, object_masks(0))
    before = {p: p.read_bytes() for p in [paths.json, paths.overlay]}
    with pytest.raises(UserError, match=r"masks\.json already exists; pass --force"):
        VideoResultWriter(video, paths)
    with pytest.raises(UserError, match=r"obj1/00000\.png already exists .*pass --force"):
        VideoResultWriter(video, VideoOutputPaths(paths.masks_dir, None, None))
    with pytest.raises(UserError, match=r"overlay\.mp4 already exists; pass --force"):
        OverlayVideoWriter(paths.overlay, H, W, FPS)
    assert {p: p.read_bytes() for p in before} == before
    with VideoResultWriter(video, paths, force=True) as writer:
        writer.add(3, object_masks(3))
    assert [f["frame"] for f in json.loads(paths.json.read_text())["frames"]] == [3]


def test_mask_png_writer_refuses_a_file_it_did_not_write(tmp_path):
    writer = MaskPngWriter(tmp_path)
    writer.write(0, {2: object_masks(0)[1]})
    writer.write(0, {2: object_masks(1)[1]})  # its own file: replaced
    assert np.array_equal(np.asarray(Image.open(tmp_path / "obj2" / "00000.png")) == 255, object_masks(1)[1])
    (tmp_path / "obj2" / "00001.png").write_bytes(b"the user's")
    with pytest.raises(UserError, match=r"obj2/00001\.png already exists; pass --force"):
        writer.write(1, {2: object_masks(1)[1]})
    assert (tmp_path / "obj2" / "00001.png").read_bytes() == b"the user's"


def test_an_aborted_overlay_leaves_nothing(tmp_path, mp4):
    video = open_video(mp4)
    with pytest.raises(RuntimeError), OverlayVideoWriter(tmp_path / "o.mp4", H, W, FPS) as writer:
        writer.write(video.frame(0))
        raise RuntimeError("the model failed")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError), VideoResultWriter(video, VideoOutputPaths.in_directory(tmp_path)) as results:
        results.add(0, object_masks(0))
        raise RuntimeError("the model failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["masks"]  # the PNGs written so far, no JSON or video


def test_overlay_without_libx264_is_mpeg4(tmp_path, monkeypatch, mp4):
    monkeypatch.setattr(video_io, "_video_encoder", lambda: "mpeg4")  # a PyAV built without libx264
    video = open_video(mp4)
    with OverlayVideoWriter(tmp_path / "o.mp4", H, W, FPS) as writer:
        for _, frame in video.frames():
            writer.write(frame)
    with av.open(str(tmp_path / "o.mp4")) as container:
        assert container.streams.video[0].codec_context.name == "mpeg4"
        for i, frame in enumerate(container.decode(video=0)):
            check_frame(frame.to_ndarray(format="rgb24"), i)
    assert i == N - 1


def test_overlay_file_must_be_mp4(tmp_path):
    with pytest.raises(UserError, match=r"name it .*o\.mp4"):
        OverlayVideoWriter(tmp_path / "o.avi", H, W, FPS)


def test_mask_store_replaces_a_frame_given_again():
    with MaskStore(H, W) as store:
        store.add(4, object_masks(4))
        store.add(2, {1: object_masks(2)[1]})
        store.add(4, {1: object_masks(5)[1]})
        assert store.frame_indices() == [2, 4] and store.object_ids() == [1, 7]
        assert list(store.masks(4)) == [1]
        assert np.array_equal(store.masks(4)[1], object_masks(5)[1])
        assert store.masks(3) == {} and store.records(3) == []
        with pytest.raises(ValueError, match="shape"):
            store.add(0, {1: np.zeros((H + 1, W), dtype=bool)})
