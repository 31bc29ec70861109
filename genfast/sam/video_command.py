"""`genfast segment VIDEO`: SAM 2 on a video file or a folder of frames.

    genfast pull sam2.1-hiera-tiny
    genfast segment clip.mp4 --point 320,240 -o out/                       # one object, clicked on frame 0
    genfast segment clip.mp4 --point 320,240 --point 100,80 --object 1 --object 2 -o out/
    genfast segment frames/ --box 40,60,200,220 --frame 30 -o out/         # tracked both ways from frame 30

Prompts: each --point (with its --label) and --box is one prompt; --object ID and --frame N say
which object it belongs to and on which frame it is given, either once for all prompts or once
per prompt (points first, then boxes, in the order given). Every object is tracked forwards from
its earliest prompted frame to the end, then backwards to the first frame.
Outputs in OUTDIR (never over existing files without --force): masks/obj{ID}/{FRAME:05d}.png,
masks.json (uncompressed RLE per object and frame) and overlay.mp4 (--no-overlay leaves it out).
Frames are decoded as they are needed, never all at once: memory does not grow with the video.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from genfast.errors import UserError

if TYPE_CHECKING:
    from genfast.sam.modeling.sam import Sam
    from genfast.sam.sam2.modeling.model import Sam2
    from genfast.sam.video_io import VideoFrames

VIDEO_SUFFIXES = (".mp4", ".mov", ".m4v", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts")
DEFAULT_VIDEO_MODEL = "sam2.1-hiera-tiny"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class VideoPrompt:
    frame: int
    object_id: int
    points: np.ndarray | None  # [N, 2]
    labels: np.ndarray | None  # [N]
    box: np.ndarray | None  # [4]
    text: str  # the flag as typed, for messages


def _per_prompt(values: list[str] | None, count: int, flag: str) -> list[int]:
    """--object / --frame values: none (default), one for all prompts, or one per prompt."""
    if not values:
        return []
    if len(values) not in (1, count):
        raise UserError(
            f"got {len(values)} {flag} for {count} prompts: give one {flag} for all of them, or one per prompt "
            "(each --point, then each --box)"
        )
    parsed = []
    for value in values:
        if not value.isdigit():
            raise UserError(f"{flag} takes a whole number >= 0, got {value!r}")
        parsed.append(int(value))
    return parsed * (count if len(values) == 1 else 1)


def parse_video_prompts(args: argparse.Namespace) -> list[VideoPrompt]:
    """The prompt flags as per-object, per-frame prompts (checked before anything slow runs).
    Points of the same object on the same frame form one prompt."""
    from genfast.sam.commands import _numbers

    if args.auto:
        raise UserError("--auto segments one image; for a video, click the objects to track with --point or --box")
    points, labels, boxes = args.point or [], args.label or [], args.box or []
    if not points and not boxes:
        raise UserError("no prompt given: pass --point X,Y and/or --box X0,Y0,X1,Y1 for the objects to track")
    if labels and len(labels) != len(points):
        raise UserError(f"got {len(labels)} --label for {len(points)} --point; give one label per point or none")
    for text in labels:
        if text not in ("0", "1"):
            raise UserError(f"--label must be 1 (foreground) or 0 (background), got {text!r}")
    count = len(points) + len(boxes)
    objects = _per_prompt(args.object, count, "--object") or [1] * count
    frames = _per_prompt(args.frame, count, "--frame") or [0] * count
    grouped: dict[tuple[int, int], dict[str, Any]] = {}
    for i, text in enumerate(points):
        entry = grouped.setdefault((frames[i], objects[i]), {"points": [], "labels": [], "box": None, "text": []})
        entry["points"].append(_numbers(text, 2, "--point", "X,Y"))
        entry["labels"].append(int(labels[i]) if labels else 1)
        entry["text"].append(f"--point {text}")
    for j, text in enumerate(boxes):
        i = len(points) + j
        entry = grouped.setdefault((frames[i], objects[i]), {"points": [], "labels": [], "box": None, "text": []})
        if entry["box"] is not None:
            raise UserError(f"two --box for object {objects[i]} on frame {frames[i]}: one box per object and frame")
        box = _numbers(text, 4, "--box", "X0,Y0,X1,Y1")
        if not (box[0] < box[2] and box[1] < box[3]):
            raise UserError(f"--box {text} must be X0,Y0,X1,Y1 with X0 < X1 and Y0 < Y1")
        entry["box"] = np.array(box)
        entry["text"].append(f"--box {text}")
    return [
        VideoPrompt(
            frame,
            obj,
            np.array(e["points"], dtype=np.float32) if e["points"] else None,
            np.array(e["labels"], dtype=np.int32) if e["points"] else None,
            e["box"],
            " ".join(e["text"]),
        )
        for (frame, obj), e in sorted(grouped.items())
    ]


def check_video_prompts(prompts: list[VideoPrompt], num_frames: int, height: int, width: int) -> None:
    where = f"the video is {width}x{height} pixels: x must be in 0..{width}, y in 0..{height}"
    for prompt in prompts:
        if prompt.frame >= num_frames:
            raise UserError(
                f"--frame {prompt.frame} is out of range: the video has {num_frames} frames (0 to {num_frames - 1})"
            )
        coords = [] if prompt.points is None else list(prompt.points)
        if prompt.box is not None:
            coords += [prompt.box[:2], prompt.box[2:]]
        for x, y in coords:
            if not (0 <= x <= width and 0 <= y <= height):
                raise UserError(f"{prompt.text} is outside the frame ({where})")


def require_sam2(model: Sam | Sam2, description: str, hint: str) -> None:
    """Refuse a SAM (1) model for a video: only SAM 2 has the memory that tracks objects."""
    from genfast.sam.sam2.modeling.model import Sam2

    if not isinstance(model, Sam2):
        raise UserError(f"{description} is a SAM (1) model: videos need SAM 2 ({hint})")


def track_objects(
    model: Sam2, video: VideoFrames, prompts: list[VideoPrompt]
) -> Iterator[tuple[int, dict[int, np.ndarray]]]:
    """Each frame's masks (object id -> bool HxW) as SAM 2 tracks the prompted objects: forwards
    from the earliest prompted frame to the end, then backwards to the first frame; every frame
    once, as it is tracked (the caller decides what to keep: nothing here grows with the video)."""
    from genfast.sam.sam2.video import SAM2VideoPredictor

    predictor = SAM2VideoPredictor(model)
    state = predictor.init_state(video)
    for p in prompts:
        predictor.add_new_points_or_box(
            state, p.frame, p.object_id, points=p.points, labels=p.labels, box=p.box, normalize_coords=True
        )
    first = min(p.frame for p in prompts)
    for reverse in [False] + ([True] if first > 0 else []):
        for frame_idx, obj_ids, masks in predictor.propagate_in_video(state, start_frame_idx=first, reverse=reverse):
            if reverse and frame_idx == first:
                continue  # the forward pass gave it
            yield frame_idx, {int(i): masks[k, 0].cpu().numpy() > 0 for k, i in enumerate(obj_ids)}


def segment_video_command(args: argparse.Namespace) -> int:
    from genfast.interface.progress import Progress
    from genfast.platform.hardware import dtype_name, resolve_device
    from genfast.platform.threads import use_threads
    from genfast.recipe import Target
    from genfast.sam.commands import RANDOM_WEIGHTS_WARNING, load_model
    from genfast.sam.recipe import RECIPE, apply_recipe
    from genfast.sam.video_io import VideoOutputPaths, VideoResultWriter, open_video

    prompts = parse_video_prompts(args)
    if not args.output:
        raise UserError("a video's results go to a folder: give -o OUTDIR (masks/, masks.json, overlay.mp4)")
    if args.json_path:
        raise UserError("--json is for images; a video's RLE masks go to OUTDIR/masks.json")
    out = Path(args.output).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out} is a file; a video's results go to a folder")
    paths = VideoOutputPaths.in_directory(out)
    if args.no_overlay:
        paths = VideoOutputPaths(paths.masks_dir, paths.json, None)
    elif args.overlay:
        paths = VideoOutputPaths(paths.masks_dir, paths.json, Path(args.overlay).expanduser())
    device = resolve_device(args.device)
    video = open_video(args.image)
    check_video_prompts(prompts, video.num_frames, video.height, video.width)
    plan = RECIPE.plan(args.recipe, Target(device, dtype_name(args.dtype)))
    use_threads(args.threads)
    if args.model is None and args.checkpoint is None:
        args.model = DEFAULT_VIDEO_MODEL
    loaded = load_model(args, device)
    require_sam2(loaded.model, loaded.description, "--model sam2.1-hiera-tiny, or a sam2.1_hiera_*.pt --checkpoint")
    apply_recipe(loaded.model, plan.settings)
    if loaded.random_weights:
        _log(f"genfast: WARNING: {RANDOM_WEIGHTS_WARNING}")
    _log(f"genfast: SAM 2 {loaded.description} | recipe {args.recipe} in {plan.settings.dtype} on {device}")
    for message in plan.messages():
        _log(f"genfast: {message}")
    _log(
        f"genfast: {video.path}: {video.num_frames} frames of {video.width}x{video.height}"
        + (f" at {video.fps:.3g} fps" if video.fps else "")
    )

    header = {"model": loaded.description, "random_weights": loaded.random_weights}
    if loaded.random_weights:
        header["warning"] = RANDOM_WEIGHTS_WARNING
    header["prompts"] = [
        {
            "frame": p.frame,
            "object_id": p.object_id,
            "points": None if p.points is None else p.points.tolist(),
            "labels": None if p.labels is None else p.labels.tolist(),
            "box": None if p.box is None else p.box.tolist(),
        }
        for p in prompts
    ]
    png_text = {"genfast:model": loaded.description, "genfast:random-weights": str(loaded.random_weights).lower()}
    start = time.perf_counter()
    with VideoResultWriter(video, paths, args.force, header, png_text) as writer:
        progress = Progress(video.num_frames, "frames")
        for frame_idx, masks in track_objects(loaded.model, video, prompts):
            writer.add(frame_idx, masks)
            progress.advance()
        progress.finish()
        tracked_s = time.perf_counter() - start
        _log("genfast: writing masks.json" + (" and the overlay video ..." if paths.overlay else ""))
    written = [p for p in (paths.masks_dir, paths.json, paths.overlay) if p is not None]
    _log(
        f"genfast: tracked {len({p.object_id for p in prompts})} object(s) through {progress.done} frames in "
        f"{tracked_s:.1f} s ({progress.done / max(tracked_s, 1e-9):.2f} frames/s)\n"
        f"genfast: wrote {', '.join(str(p) for p in written)}"
    )
    if loaded.random_weights:
        _log(f"genfast: WARNING: {RANDOM_WEIGHTS_WARNING}")
    return 0
