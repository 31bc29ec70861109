"""Video in and segmentation results out, for `genfast segment VIDEO`, independent of the model.

Reading: `open_video(path)` gives a `VideoFrames` over a video file (anything FFmpeg reads, through
PyAV) or a folder of .jpg/.jpeg/.png frames. Frames are decoded on demand, never all at once (a
300-frame 1080p video is 1.9 GB as RGB); a small LRU cache, bounded in bytes, makes forward and
backward iteration cheap:
- the file is demuxed once when opened (packets only, no decoding): every frame's timestamp and
  which frames are keyframes, so the frame count is exact and frame i is found by its timestamp;
- frame i is decoded from the keyframe at or before it, unless the decoder is already on its way
  there; the frames decoded on the way are cached, so reverse iteration decodes each group of
  pictures once (when the cache holds a whole group; else a cache-full at a time);
- frames are RGB as displayed: a rotation in the file's display matrix (phone videos) is applied,
  as EXIF orientation is for images; coordinates of prompts and masks are those of these frames.

Writing (every writer accepts frames one at a time; nothing is overwritten without `force`, the
CLI's --force; each file is written to a temp file beside it and renamed into place):
- `MaskPngWriter`: one 8-bit PNG per object and frame, 255 inside the mask:
  MASKS_DIR/obj{object_id}/{frame:05d}.png (a folder per object: each is an image sequence);
- `MaskStore`: each frame's masks as uncompressed COCO RLE records, spooled to a temp file;
  frames may come in any order (SAM 2 propagates forward, then backward) and a frame given again
  replaces its earlier masks; `write_json` writes them sorted by frame;
- `OverlayVideoWriter`: an H.264 .mp4 (yuv420p, widely playable; MPEG-4 Part 2 where PyAV's FFmpeg
  lacks libx264) of the frames with each object's mask tinted in its own colour;
- `VideoResultWriter` ties them together under one output folder (`VideoOutputPaths`):
  OUTDIR/masks/obj{id}/{frame:05d}.png, OUTDIR/masks.json and OUTDIR/overlay.mp4. The overlay is
  made when it closes, in a forward pass over the video, from the stored RLEs.
"""

from __future__ import annotations

import bisect
import json
import operator
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import IO, Any

import av
import numpy as np
import torch

from genfast import __version__
from genfast.errors import UserError
from genfast.interface import images as image_files
from genfast.sam import images
from genfast.sam.masks import box_xyxy_to_xywh, mask_to_rle, masks_to_boxes, rle_to_mask
from genfast.storage.files import check_outputs, make_public

FRAME_SUFFIXES = (".jpg", ".jpeg", ".png")
DEFAULT_CACHE_BYTES = 512 * 2**20  # 86 frames of 1080p RGB
DEFAULT_FPS = 30.0  # a folder of frames has no frame rate: its overlay video plays at this one
MASK_FILE = "obj{object_id}/{frame:05d}.png"  # under the masks folder


# ---- reading -----------------------------------------------------------------------------------


def open_video(path: str | Path, cache_bytes: int = DEFAULT_CACHE_BYTES) -> VideoFrames:
    """A video file or a folder of frames, opened for reading; `cache_bytes` bounds the decoded
    frames kept in memory (at least two are kept)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(
            f"video {str(path)!r} does not exist; give a video file (.mp4 or another format FFmpeg reads) "
            "or a folder of .jpg/.png frames"
        )
    if path.is_dir():
        return FrameFolder(path, cache_bytes)
    return VideoFile(path, cache_bytes)


class VideoFrames:
    """Frames of a video as HxWx3 uint8 RGB arrays, decoded on demand and cached (LRU, bounded).

    `num_frames` (also len()), `height`, `width` and `fps` (None for a folder of frames) describe
    it; `frame(i)` is random access, `frames(start, stop, reverse)` iterates over a range.
    """

    path: Path
    num_frames: int
    height: int
    width: int
    fps: float | None

    def __init__(self, path: Path, cache_bytes: int) -> None:
        self.path = path
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_bytes = cache_bytes
        self.cache_capacity = 2  # frames; set from the frame size when the first frame comes
        self.decoded_frames = 0  # frames decoded so far: decoding work, for tests and benchmarks
        self._sized = False

    def __len__(self) -> int:
        return self.num_frames

    def __iter__(self) -> Iterator[np.ndarray]:
        for _, frame in self.frames():
            yield frame

    def __enter__(self) -> VideoFrames:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._cache.clear()

    def frame(self, index: int) -> np.ndarray:
        """Frame `index` (0-based) as HxWx3 uint8 RGB, read-only (it is cached: copy it to modify it)."""
        index = operator.index(index)
        if not 0 <= index < self.num_frames:
            raise UserError(
                f"frame {index} is out of range: {self.path} has {self.num_frames} frames, "
                f"numbered 0 to {self.num_frames - 1}"
            )
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        self._decode(index)
        return self._cache[index]

    def frames(
        self, start: int = 0, stop: int | None = None, reverse: bool = False
    ) -> Iterator[tuple[int, np.ndarray]]:
        """(index, frame) for the frames start <= index < stop, in increasing order, or decreasing
        with `reverse` (stop - 1 down to start)."""
        stop = self.num_frames if stop is None else stop
        if not 0 <= start <= stop <= self.num_frames:
            raise UserError(
                f"frame range {start}:{stop} is out of range: {self.path} has {self.num_frames} frames; "
                f"give 0 <= start <= stop <= {self.num_frames}"
            )
        order = range(stop - 1, start - 1, -1) if reverse else range(start, stop)
        for index in order:
            yield index, self.frame(index)

    def cached_indices(self) -> list[int]:
        """Indices of the frames held in the cache, least recently used first."""
        return list(self._cache)

    def cached_bytes(self) -> int:
        """Bytes of the decoded frames held in the cache (at most the `cache_bytes` it was opened with)."""
        return sum(frame.nbytes for frame in self._cache.values())

    def _decode(self, index: int) -> None:
        """Decode frame `index` into the cache (and, where cheap, frames near it)."""
        raise NotImplementedError

    def _put(self, index: int, frame: np.ndarray) -> None:
        if not self._sized:
            self.cache_capacity = max(2, self._cache_bytes // max(1, frame.nbytes))
            self._sized = True
        frame.flags.writeable = False  # a caller's in-place edit would corrupt the cache
        self._cache[index] = frame
        self._cache.move_to_end(index)
        while len(self._cache) > self.cache_capacity:
            self._cache.popitem(last=False)


def _frame_order(names: Sequence[str]) -> list[str]:
    """The official sam2 package's order for a folder of frames: by the integer value of the file
    stem (1, 2, 10) when every stem is an integer, else by name."""
    stems = [Path(n).stem for n in names]
    if all(re.fullmatch(r"\d+", s) for s in stems):
        return [n for _, n in sorted(zip((int(s) for s in stems), names))]
    return sorted(names)


class FrameFolder(VideoFrames):
    """A folder of .jpg/.jpeg/.png frames (hidden files, such as macOS's ._00001.jpg, ignored),
    all of one size. It has no frame rate: `fps` is None."""

    def __init__(self, path: Path, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        super().__init__(path, cache_bytes)
        entries = [e for e in path.iterdir() if not e.name.startswith(".")]
        if not entries:
            raise UserError(
                f"folder {str(path)!r} is empty; put the video's frames in it as .jpg or .png files "
                "(00000.jpg, 00001.jpg, ...), or give a video file"
            )
        names = [e.name for e in entries if e.is_file() and e.suffix.lower() in FRAME_SUFFIXES]
        if not names:
            found = sorted(e.name for e in entries)
            listed = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
            raise UserError(
                f"folder {str(path)!r} has no .jpg, .jpeg or .png frames (it holds {listed}); "
                "give a folder of frames or a video file"
            )
        self.files = [path / n for n in _frame_order(names)]
        self.num_frames = len(self.files)
        self.fps = None
        self.height, self.width = self.frame(0).shape[:2]

    def _decode(self, index: int) -> None:
        frame = image_files.load_image(self.files[index])
        self.decoded_frames += 1
        if index != 0 and frame.shape[:2] != (self.height, self.width):
            raise UserError(
                f"frame {self.files[index]} is {frame.shape[1]}x{frame.shape[0]} but the first frame, "
                f"{self.files[0].name}, is {self.width}x{self.height}; every frame of a video must have one size"
            )
        self._put(index, frame)


class VideoFile(VideoFrames):
    """A video file's first video stream, decoded with PyAV (FFmpeg)."""

    def __init__(self, path: Path, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        super().__init__(path, cache_bytes)
        self._container = self._open()
        try:
            self._index()
            rate = self._stream.average_rate or self._stream.guessed_rate
            self.fps = float(rate) if rate else None
            self._rotation: int | None = None  # quarter turns counterclockwise; read from the first frame
            self._live: Iterator[tuple[int, av.VideoFrame]] | None = None  # the decoder, where it is
            self._position = -1  # index of the frame the live decoder gave last
            self.height, self.width = self.frame(0).shape[:2]
        except BaseException:
            self._container.close()
            raise

    def close(self) -> None:
        super().close()
        self._live = None
        self._container.close()

    def _open(self) -> av.container.InputContainer:
        try:
            container = av.open(str(self.path))
        except (av.FFmpegError, OSError, UnicodeDecodeError) as e:
            raise UserError(
                f"cannot read {str(self.path)!r} as a video ({_reason(e)}); give an .mp4 or another format "
                "FFmpeg reads, or a folder of .jpg/.png frames"
            ) from e
        if not container.streams.video:
            audio = bool(container.streams.audio)
            container.close()
            if audio:
                raise UserError(f"{str(self.path)!r} has no video stream, only audio; give a video")
            # A file cut short before its video stream is described, say.
            raise UserError(
                f"cannot read {str(self.path)!r} as a video (FFmpeg finds no video stream in it); give an "
                ".mp4 or another format FFmpeg reads, or a folder of .jpg/.png frames"
            )
        self._stream = container.streams.video[0]
        self._stream.thread_type = "AUTO"  # frame- and slice-threaded decoding
        return container

    def _index(self) -> None:
        """Demux the stream once (no decoding): the presentation timestamp of every frame, in
        order, and the keyframes to seek to. Counting packets is exact where the header's count
        (stream.frames) is absent (Matroska, WebM, MPEG-TS) and, unlike it, skips the packets an
        edit list discards, which the decoder drops too. A file cut short (a partial copy or
        download) is refused: fewer packets than its header lists, or a last one cut off."""
        packets = []  # (pts, dts, keyframe)
        demuxed, cut_off = 0, False
        try:
            for packet in self._container.demux(self._stream):
                if packet.size:  # the last, empty packet only flushes
                    demuxed += 1
                    cut_off = packet.is_corrupt
                    if not packet.is_discard:
                        packets.append((packet.pts, packet.dts, packet.is_keyframe))
        except av.FFmpegError as e:
            raise UserError(f"cannot read {str(self.path)!r}: the video is damaged ({_reason(e)})") from e
        if not packets:
            raise UserError(f"{str(self.path)!r} has a video stream without frames; give a video with frames")
        if cut_off or demuxed < self._stream.frames:
            raise UserError(
                f"{str(self.path)!r} is truncated: it holds only {demuxed - cut_off} of its "
                f"{max(demuxed, self._stream.frames)} frames whole; copy or download it again"
            )
        self.num_frames = len(packets)
        pts = [p[0] for p in packets]
        # Raw streams (.h264) have no timestamps: frames are then numbered in decoding order from
        # the start, where every seek backwards restarts.
        self._timestamped = None not in pts and len(set(pts)) == len(pts)
        self._index_of: dict[int, int] = {}
        # Keyframes by their place in presentation order, with the timestamps to seek to them:
        # their presentation timestamp, which MP4 and Matroska seek to exactly, and one at or before
        # it (the decoding timestamp) for formats that seek by an estimate and would land after it
        # (MPEG-TS). Frame 0 is always a place to start from: the file is reopened.
        self._keyframes, self._seek_ts, self._early_ts = [0], [0], [0]
        self._seek_early = False  # set once a seek to a presentation timestamp has landed too late
        if self._timestamped:
            self._index_of = {t: i for i, t in enumerate(sorted(pts))}
            for index, t, d in sorted((self._index_of[t], t, d) for t, d, key in packets if key):
                if index > 0:
                    self._keyframes.append(index)
                    self._seek_ts.append(t)
                    self._early_ts.append(t if d is None else min(t, d))

    def _decode(self, index: int) -> None:
        keyframe = self._keyframe_at_or_before(index)
        if self._decode_from(index, keyframe):
            return
        # The seek landed past the frame (decoders skip to the next keyframe): seek early from now
        # on, then, should that fail too, decode from the start. If even that does not reach the
        # frame, the file is damaged.
        if not self._seek_early and keyframe > 0:
            self._seek_early = True
            if self._decode_from(index, keyframe):
                return
        if not self._decode_from(index, 0):
            raise UserError(
                f"cannot decode frame {index} of {self.path}: the stream ends or breaks off before it "
                "(the file is damaged or truncated)"
            )

    def _keyframe_at_or_before(self, index: int) -> int:
        return self._keyframes[bisect.bisect_right(self._keyframes, index) - 1]

    def _decode_from(self, index: int, keyframe: int) -> bool:
        """Decode up to frame `index`, continuing the live decoder where it is at most at
        `keyframe` and before `index`, else seeking to `keyframe`; True once the frame is cached."""
        if self._live is None or not (keyframe <= self._position + 1 and self._position < index):
            self._live = self._decoder(keyframe)
            self._position = keyframe - 1
        keep_from = index - self.cache_capacity + 1  # frames before it would be evicted by `index`
        try:
            for position, frame in self._live:
                self._position = position
                if position >= keep_from:
                    self._put(position, self._to_rgb(frame))
                if position >= index:
                    if index in self._cache:
                        return True
                    break  # past it: the seek landed too late
        except av.FFmpegError as e:
            self._live = None
            raise UserError(f"cannot decode frame {index} of {self.path}: the video is damaged ({_reason(e)})") from e
        self._live = None
        return False

    def _decoder(self, keyframe: int) -> Iterator[tuple[int, av.VideoFrame]]:
        """(index, frame) of the frames decoded after seeking to `keyframe`, from it on."""
        if keyframe == 0:  # reopened: seeking before the first keyframe is not safe in every format
            self._container.close()
            self._container = self._open()
        else:
            n = bisect.bisect_left(self._keyframes, keyframe)
            seek_ts = self._early_ts[n] if self._seek_early else self._seek_ts[n]
            self._container.seek(seek_ts, stream=self._stream, backward=True)
        for count, frame in enumerate(self._container.decode(self._stream)):
            self.decoded_frames += 1
            position = self._index_of.get(frame.pts, -1) if self._timestamped else count
            if position >= keyframe:  # earlier frames (an open GOP's leading ones) may be broken
                yield position, frame

    def _to_rgb(self, frame: av.VideoFrame) -> np.ndarray:
        if self._rotation is None:
            self._rotation = round((frame.rotation or 0) / 90) % 4
            self._coded = (frame.width, frame.height)
        # Scaled to the first frame's size should the stream change size midway.
        rgb = frame.to_ndarray(format="rgb24", width=self._coded[0], height=self._coded[1])
        return np.ascontiguousarray(np.rot90(rgb, self._rotation)) if self._rotation else rgb


def _reason(error: BaseException) -> str:
    """FFmpeg's words for an error, without PyAV's errno and file name."""
    return getattr(error, "strerror", None) or str(error) or type(error).__name__


def video_info(video: VideoFrames) -> dict[str, Any]:
    """The video's description for a results JSON."""
    return {
        "path": str(video.path),
        "num_frames": video.num_frames,
        "height": video.height,
        "width": video.width,
        "fps": video.fps,
    }


# ---- writing -----------------------------------------------------------------------------------


def _binary(mask: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> np.ndarray:
    """A mask as bool HxW: boolean masks as they are, others (0/1, 0/255, SAM's logits) > 0; a
    leading singleton dimension ([1, H, W], as SAM 2 gives them) is dropped."""
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.ndim == 3 and mask.shape[0] == 1:
        mask = mask[0]
    if mask.shape != shape:
        raise ValueError(f"expected a mask of shape {shape} (the video's height and width), got {mask.shape}")
    return mask if mask.dtype == bool else mask > 0


class _Staged:
    """A temp file beside `path` (same suffix, so that FFmpeg knows the format) to write `path`
    through: `commit()` renames it over `path`, `discard()` removes it (a no-op once committed).
    Readers never see a half-written file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
        os.close(fd)
        self.tmp = Path(tmp)
        make_public(tmp)

    def commit(self) -> None:
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


class MaskPngWriter:
    """Masks as 8-bit grayscale PNGs (255 inside, 0 outside), DIRECTORY/obj{id}/{frame:05d}.png.

    Refuses, without `force`, a folder that already holds such files (before any work) and any
    existing file it would write; files it wrote itself it replaces (a frame given again). `text`
    goes into every PNG as metadata, with the frame and object.
    """

    def __init__(self, directory: str | Path, force: bool = False, text: Mapping[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.force = force
        self.text = {"Software": f"genfast {__version__}", **(text or {})}
        self._written: set[Path] = set()
        if not force and self.directory.is_dir():
            earlier = next(iter(sorted(self.directory.glob("obj*/*.png"))), None)
            if earlier is not None:
                raise UserError(f"{earlier} already exists (masks of an earlier run); pass --force to overwrite them")

    def path(self, frame_index: int, object_id: int) -> Path:
        return self.directory / MASK_FILE.format(object_id=object_id, frame=frame_index)

    def write(self, frame_index: int, masks: Mapping[int, np.ndarray]) -> list[Path]:
        """Write one frame's masks (object id -> HxW mask), all or nothing; returns their paths."""
        files = {}
        for object_id, mask in masks.items():
            path = self.path(frame_index, object_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            text = {**self.text, "genfast:frame": str(frame_index), "genfast:object": str(object_id)}
            binary = _binary(mask, tuple(np.shape(mask)[-2:]))
            files[path] = image_files.png_bytes(images.mask_image(binary), text)
        check_outputs([p for p in files if p not in self._written], self.force)
        image_files.write_files(files, force=True)  # checked just above; our own files may be replaced
        self._written.update(files)
        return list(files)


def encode_masks(masks: Mapping[int, np.ndarray]) -> list[dict[str, Any]]:
    """One frame's masks (object id -> bool HxW) as records: object_id, area (pixels), bbox (XYWH,
    inclusive pixel coordinates, as `genfast segment` gives for images) and segmentation (an
    uncompressed COCO RLE: {"size": [H, W], "counts": [...]}, column-major, background first)."""
    if not masks:
        return []
    ids = list(masks)
    stacked = torch.from_numpy(np.stack([masks[i] for i in ids]))
    rles = mask_to_rle(stacked)
    boxes = box_xyxy_to_xywh(masks_to_boxes(stacked)).tolist()
    areas = stacked.sum(dim=(1, 2)).tolist()
    return [
        {"object_id": int(i), "area": int(a), "bbox": box, "segmentation": rle}
        for i, a, box, rle in zip(ids, areas, boxes, rles)
    ]


class MaskStore:
    """Each frame's masks as RLE records (see encode_masks), kept in an anonymous temp file:
    memory holds only an offset per frame. Frames may come in any order; a frame given again
    replaces its earlier masks."""

    def __init__(self, height: int, width: int) -> None:
        self.shape = (height, width)
        self._spool: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (open until close())
        self._where: dict[int, tuple[int, int]] = {}  # frame -> (offset, length) in the spool
        self._objects: set[int] = set()

    def __enter__(self) -> MaskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._spool.close()

    def add(self, frame_index: int, masks: Mapping[int, np.ndarray]) -> list[dict[str, Any]]:
        """Store one frame's masks (object id -> HxW mask); returns its records."""
        records = encode_masks({int(i): _binary(m, self.shape) for i, m in masks.items()})
        data = json.dumps({"frame": int(frame_index), "masks": records}, separators=(",", ":")).encode()
        offset = self._spool.seek(0, os.SEEK_END)
        self._spool.write(data)
        self._where[int(frame_index)] = (offset, len(data))
        self._objects.update(int(i) for i in masks)
        return records

    def frame_indices(self) -> list[int]:
        return sorted(self._where)

    def object_ids(self) -> list[int]:
        return sorted(self._objects)

    def _chunk(self, frame_index: int) -> bytes:
        offset, length = self._where[frame_index]
        self._spool.seek(offset)
        return self._spool.read(length)

    def records(self, frame_index: int) -> list[dict[str, Any]]:
        """The frame's records; [] for a frame never added."""
        return json.loads(self._chunk(frame_index))["masks"] if frame_index in self._where else []

    def masks(self, frame_index: int) -> dict[int, np.ndarray]:
        """The frame's masks, object id -> bool HxW; {} for a frame never added."""
        return {r["object_id"]: rle_to_mask(r["segmentation"]).numpy() for r in self.records(frame_index)}

    def write_json(
        self, path: str | Path, header: Mapping[str, Any] | None = None, force: bool = False, inputs: Sequence = ()
    ) -> None:
        """Write `header`'s fields, then "frames": [{"frame": i, "masks": [records]}] sorted by
        frame (one a line), atomically, streaming from the spool."""
        path = Path(path)
        check_outputs([path], force, inputs)
        staged = _Staged(path)
        try:
            with open(staged.tmp, "w") as f:
                f.write("{\n")
                for key, value in (header or {}).items():
                    f.write(f"  {json.dumps(key)}: {json.dumps(value, default=str)},\n")
                f.write('  "frames": [')
                for n, frame_index in enumerate(self.frame_indices()):
                    f.write(",\n    " if n else "\n    ")
                    f.write(self._chunk(frame_index).decode())
                f.write("\n  ]\n}\n")
            staged.commit()
        finally:
            staged.discard()


def _check_mp4_name(path: Path) -> None:
    if path.suffix.lower() != ".mp4":
        raise UserError(f"{path}: genfast writes overlay videos as MP4; name it {path.with_suffix('.mp4')}")


def _video_encoder() -> str:
    """H.264 (libx264) where PyAV's FFmpeg has it, as PyPI's wheels do: it plays everywhere.
    MPEG-4 Part 2 (FFmpeg's own encoder, always there) otherwise."""
    try:
        av.codec.Codec("libx264", "w")
        return "libx264"
    except av.FFmpegError:
        return "mpeg4"


class OverlayVideoWriter:
    """An .mp4 of frames with masks tinted in their objects' colours (and outlined), written
    one frame at a time, in order. yuv420p needs even sizes: an odd height or width gets one
    more row or column, a copy of the last. Colours follow `object_ids`' order (images.colour),
    objects not in it taking the next ones as they appear; masks are drawn in that order.
    The file appears at `close()`; `abort()` (or an error inside `with`) leaves nothing."""

    def __init__(
        self,
        path: str | Path,
        height: int,
        width: int,
        fps: float | None,
        force: bool = False,
        object_ids: Sequence[int] = (),
        inputs: Sequence = (),
    ) -> None:
        self.path = Path(path)
        _check_mp4_name(self.path)
        check_outputs([self.path], force, inputs)
        self.shape = (height, width)
        self._colours = {int(i): images.colour(n) for n, i in enumerate(object_ids)}
        self.frames_written = 0
        self._staged: _Staged | None = _Staged(self.path)
        try:
            # faststart: the index at the front, so players and browsers start before the end arrives.
            self._container = av.open(str(self._staged.tmp), "w", format="mp4", options={"movflags": "+faststart"})
            codec = _video_encoder()
            options = {"crf": "20", "preset": "veryfast"} if codec == "libx264" else {}
            rate = Fraction(fps or DEFAULT_FPS).limit_denominator(100_000)  # 29.97 -> 30000/1001
            self._stream = self._container.add_stream(codec, rate=rate, options=options)
            if codec == "mpeg4":  # constant quality (-q:v 3), not the default 200 kb/s, blurry at 1080p
                self._stream.codec_context.qscale = True
                self._stream.codec_context.global_quality = 3 * 118  # FF_QP2LAMBDA
            self._stream.height, self._stream.width = height + height % 2, width + width % 2
            self._stream.pix_fmt = "yuv420p"
        except BaseException:
            self._staged.discard()
            raise

    def __enter__(self) -> OverlayVideoWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def colour(self, object_id: int) -> tuple[int, int, int]:
        if object_id not in self._colours:
            self._colours[object_id] = images.colour(len(self._colours))
        return self._colours[object_id]

    def write(self, frame: np.ndarray, masks: Mapping[int, np.ndarray] | None = None) -> None:
        """Append one HxWx3 uint8 RGB frame with `masks` (object id -> HxW mask) tinted over it."""
        if frame.shape != (*self.shape, 3):
            raise ValueError(f"expected a frame of shape {(*self.shape, 3)}, got {frame.shape}")
        if masks:
            masks = {int(i): m for i, m in masks.items()}
            for object_id in sorted(masks):  # new objects take the next colours, in id order
                self.colour(object_id)
            ids = [i for i in self._colours if i in masks]
            binary = [_binary(masks[i], self.shape) for i in ids]
            frame = np.asarray(images.overlay_image(frame, binary, [self._colours[i] for i in ids]))
        height, width = self.shape
        if height % 2 or width % 2:
            frame = np.pad(frame, ((0, height % 2), (0, width % 2), (0, 0)), mode="edge")
        video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
        for packet in self._stream.encode(video_frame):
            self._container.mux(packet)
        self.frames_written += 1

    def close(self) -> None:
        """Flush the encoder and put the file in place."""
        if self._staged is None:
            return
        staged, self._staged = self._staged, None
        try:
            for packet in self._stream.encode():
                self._container.mux(packet)
            self._container.close()
            staged.commit()
        finally:
            self._container.close()
            staged.discard()

    def abort(self) -> None:
        """Discard the video: no file appears."""
        if self._staged is None:
            return
        staged, self._staged = self._staged, None
        try:
            self._container.close()
        finally:
            staged.discard()


@dataclass(frozen=True)
class VideoOutputPaths:
    """Where `VideoResultWriter` writes; None leaves an output out."""

    masks_dir: Path | None
    json: Path | None
    overlay: Path | None

    @classmethod
    def in_directory(cls, out_dir: str | Path) -> VideoOutputPaths:
        """OUTDIR/masks/obj{id}/{frame:05d}.png, OUTDIR/masks.json and OUTDIR/overlay.mp4."""
        out_dir = Path(out_dir)
        return cls(out_dir / "masks", out_dir / "masks.json", out_dir / "overlay.mp4")

    def files(self) -> list[Path]:
        return [p for p in (self.json, self.overlay) if p is not None]


class VideoResultWriter:
    """A video's segmentation results, given a frame at a time in any order (`add`): mask PNGs
    written at once, RLEs stored; `close()` writes the JSON (sorted by frame) and then the overlay
    video, in a forward pass over `video`. Every output is checked before any work (missing
    folders are created); an error inside `with` leaves the PNGs written so far and no JSON or
    overlay.

    The JSON holds "genfast_version", `header`'s fields, "video" (video_info), "object_ids",
    "mask_files" (the PNGs' path pattern), "overlay_file" and "frames" (MaskStore.write_json).
    """

    def __init__(
        self,
        video: VideoFrames,
        paths: VideoOutputPaths,
        force: bool = False,
        header: Mapping[str, Any] | None = None,
        png_text: Mapping[str, str] | None = None,
    ) -> None:
        self.video, self.paths, self.force = video, paths, force
        self.header = dict(header or {})
        if paths.overlay is not None:
            _check_mp4_name(paths.overlay)
        for path in paths.files():
            if path.exists() and not force:  # before creating any folder
                raise UserError(f"{path} already exists; pass --force to overwrite it")
        for folder in [p.parent for p in paths.files()] + ([paths.masks_dir] if paths.masks_dir else []):
            folder.mkdir(parents=True, exist_ok=True)
        check_outputs(paths.files(), force, inputs=[video.path])
        text = {"genfast:video": str(video.path), **(png_text or {})}
        self.pngs = MaskPngWriter(paths.masks_dir, force, text) if paths.masks_dir else None
        self.store = MaskStore(video.height, video.width)
        self._closed = False

    def __enter__(self) -> VideoResultWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True
            self.store.close()

    def add(self, frame_index: int, masks: Mapping[int, np.ndarray]) -> None:
        """One frame's masks, object id -> HxW mask (bool, or logits/0-255 compared > 0)."""
        if not 0 <= frame_index < self.video.num_frames:
            last = self.video.num_frames - 1
            raise ValueError(f"frame {frame_index} is not a frame of {self.video.path} (0 to {last})")
        binary = {int(i): _binary(m, (self.video.height, self.video.width)) for i, m in masks.items()}
        self.store.add(frame_index, binary)
        if self.pngs is not None:
            self.pngs.write(frame_index, binary)

    def close(self) -> list[Path]:
        """Write the JSON and the overlay; returns the files written by close ([] once closed)."""
        written: list[Path] = []
        if self._closed:
            return written
        self._closed = True
        try:
            if self.paths.json is not None:
                mask_files = str(self.paths.masks_dir / MASK_FILE) if self.paths.masks_dir else None
                header = {
                    "genfast_version": __version__,
                    **self.header,
                    "video": video_info(self.video),
                    "object_ids": self.store.object_ids(),
                    "mask_files": mask_files,
                    "overlay_file": str(self.paths.overlay) if self.paths.overlay else None,
                }
                self.store.write_json(self.paths.json, header, self.force, inputs=[self.video.path])
                written.append(self.paths.json)
            if self.paths.overlay is not None:
                write_overlay_video(self.video, self.store, self.paths.overlay, self.force)
                written.append(self.paths.overlay)
        finally:
            self.store.close()
        return written


def write_overlay_video(video: VideoFrames, store: MaskStore, path: str | Path, force: bool = False) -> None:
    """The overlay video of every frame of `video`, with `store`'s masks of each (frames without
    masks plain), at the video's frame rate (DEFAULT_FPS for a folder of frames)."""
    with OverlayVideoWriter(
        path, video.height, video.width, video.fps, force, store.object_ids(), inputs=[video.path]
    ) as writer:
        for index, frame in video.frames():
            writer.write(frame, store.masks(index))
