"""`genfast.Segmenter`: Segment Anything (SAM and SAM 2) from Python, many images at a time.

Built once (load, apply the recipe), it takes images as HxWx3 uint8 arrays or file paths:
`segment(images, points=..., box=...)` gives each image its masks for the prompt (the images go
through the encoder together, `batch_size` at a time), `segment_everything(images)` every object
(the automatic mask generator). Each image's result is a `Segmentation`: boolean masks, best
first (by predicted IoU for prompts, by area for everything), and a record per mask (predicted
IoU, area, XYWH box; the automatic generator's stability score and crop box too).
`track(video, points=..., boxes=...)` follows objects through a video with SAM 2, as `genfast
segment VIDEO` does: each frame's masks by object id.

Its arguments mean what `genfast segment`'s flags do, and are checked by the same parser. A
`Segmenter` pickles as those arguments and is rebuilt from them where it is unpickled, and it is
a Ray Data callable class as it is: `__call__(batch)` segments an `image` column (what
`ray.data.read_images` gives) and adds the masks as RLE JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from genfast.errors import UserError
from genfast.interface.images import load_image
from genfast.sam import commands
from genfast.sam.commands import (
    Prompt,
    Segmentation,
    check_prompt_inside,
    parse_prompt,
    prepare_model,
    records_with_masks,
    segment_auto,
    segment_prompts,
)

if TYPE_CHECKING:
    from genfast.sam.video_io import VideoFrames

ImageInput = np.ndarray | str | Path  # HxWx3 uint8 RGB, or an image file


def _parsed_flags(flags: list[str]) -> argparse.Namespace:
    """`genfast segment`'s flags parsed as the command parses them (defaults and checks)."""
    from genfast.sam.cli import register

    parser = argparse.ArgumentParser(prog="genfast", exit_on_error=False)
    register(parser.add_subparsers())
    try:
        return parser.parse_args(["segment", "IMAGE", *flags])
    except (argparse.ArgumentError, SystemExit) as e:  # SystemExit: argparse's own exit on a bad value
        raise UserError(f"invalid Segmenter argument: {e}") from e


class Segmenter:
    """A loaded SAM or SAM 2 model that segments lists of images (and, SAM 2, tracks objects in videos).

    `model`, `checkpoint`, `random_weights`, `recipe`, `dtype`, `device` and `threads` choose and
    run the model as `genfast segment --model ...` does (default sam-vit-b from the cache);
    `points_per_side`, `points_per_batch`, `pred_iou_thresh` and `stability_score_thresh` are the
    automatic generator's; `batch_size`: images through the encoder together.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        checkpoint: str | None = None,
        random_weights: bool = False,
        recipe: str | None = None,
        dtype: str | None = None,
        device: str = "auto",
        threads: int | None = None,
        batch_size: int = 4,
        points_per_side: int = 32,
        points_per_batch: int = 64,
        pred_iou_thresh: float | None = None,
        stability_score_thresh: float = 0.95,
    ) -> None:
        from genfast.platform.hardware import resolve_device

        self._arguments = dict(
            model=model, checkpoint=checkpoint, random_weights=random_weights, recipe=recipe, dtype=dtype,
            device=device, threads=threads, batch_size=batch_size, points_per_side=points_per_side,
            points_per_batch=points_per_batch, pred_iou_thresh=pred_iou_thresh,
            stability_score_thresh=stability_score_thresh,
        )  # fmt: skip
        if batch_size < 1:
            raise UserError(f"batch_size must be at least 1, got {batch_size}")
        flags = ["--device", device, "--points-per-side", str(points_per_side)]
        flags += ["--points-per-batch", str(points_per_batch), "--stability-score-thresh", str(stability_score_thresh)]
        for flag, value in (
            ("--model", model), ("--checkpoint", checkpoint), ("--recipe", recipe), ("--dtype", dtype),
            ("--threads", threads), ("--pred-iou-thresh", pred_iou_thresh),
        ):  # fmt: skip
            if value is not None:
                flags += [flag, str(value)]
        if random_weights:
            flags.append("--random-weights")
        self.args = _parsed_flags(flags)
        self.batch_size = batch_size
        self.loaded = prepare_model(self.args, resolve_device(self.args.device))
        self.model = self.loaded.model
        self.args.pred_iou_thresh = commands.pred_iou_thresh(self.args, self.model)  # the model's default

    def segment(
        self,
        images: ImageInput | Sequence[ImageInput],
        *,
        points: Sequence[Sequence[float]] | None = None,
        labels: Sequence[int] | None = None,
        box: Sequence[float] | None = None,
        multimask: bool = False,
    ) -> list[Segmentation]:
        """The masks of one prompt on each image, in order: `points` [[x, y], ...] in pixels with
        `labels` (1 foreground, 0 background; default all foreground) and/or one `box` [x0, y0,
        x1, y1]. The best mask only, or all three by predicted IoU with `multimask`. A prompt
        outside an image, or an image that cannot be read, raises UserError naming it."""
        prompt = make_prompt(points, labels, box)
        arrays = _images(images)
        for index, image in enumerate(arrays):
            try:
                check_prompt_inside(prompt, *image.shape[:2])
            except UserError as e:
                raise UserError(f"image {index}: {e}") from e
        return self._in_batches(arrays, prompt, multimask)

    def track(
        self,
        video: str | Path | VideoFrames,
        *,
        points: Sequence[Sequence[float]] | None = None,
        labels: Sequence[int] | None = None,
        boxes: Sequence[Sequence[float]] | None = None,
        object_id: int | Sequence[int] = 1,
        frame: int | Sequence[int] = 0,
    ) -> list[dict[int, np.ndarray]]:
        """SAM 2 video tracking, as `genfast segment VIDEO` does it: each frame's masks, in frame
        order, as {object id: bool HxW mask}. `video`: a video file, a folder of numbered frames or
        an open `genfast.sam.video_io.VideoFrames`. Each of `points` [[x, y], ...] (with `labels`,
        1 foreground, 0 background) and each of `boxes` [[x0, y0, x1, y1], ...] is one prompt;
        `object_id` and `frame` say which object it marks and on which frame, once for all prompts
        or once per prompt (the points, then the boxes): the command's --object and --frame. The
        points of one object on one frame form one prompt. Every object is tracked forwards from
        the earliest prompted frame, then backwards. The masks are kept in memory (a 1080p frame's
        is 2 MB per object): for long videos, the command streams them to files. A SAM (1) model,
        a missing or unreadable video, a frame out of range or a prompt outside the frames raise
        UserError."""
        from genfast.sam.video_command import check_video_prompts, parse_video_prompts, require_sam2, track_objects
        from genfast.sam.video_io import open_video

        require_sam2(self.model, self.loaded.description, "e.g. Segmenter('sam2.1-hiera-tiny')")
        prompts = parse_video_prompts(
            argparse.Namespace(
                auto=False,
                point=[_numbers_text(p) for p in points or ()],
                label=[str(int(v)) for v in labels] if labels is not None else [],
                box=[_numbers_text(b) for b in boxes or ()],
                object=_per_prompt_text(object_id),
                frame=_per_prompt_text(frame),
            )
        )
        frames = open_video(video) if isinstance(video, (str, Path)) else video
        check_video_prompts(prompts, frames.num_frames, frames.height, frames.width)
        results: list[dict[int, np.ndarray]] = [{} for _ in range(frames.num_frames)]
        for index, masks in track_objects(self.model, frames, prompts):
            results[index] = masks
        return results

    def segment_everything(self, images: ImageInput | Sequence[ImageInput]) -> list[Segmentation]:
        """Every object of each image (the automatic mask generator), masks by decreasing area."""
        return [segment_auto(self.model, image, self.args) for image in _images(images)]

    def __call__(
        self,
        batch: dict[str, Any],
        *,
        points: Sequence[Sequence[float]] | None = None,
        labels: Sequence[int] | None = None,
        box: Sequence[float] | None = None,
        multimask: bool = False,
        everything: bool = False,
    ) -> dict[str, Any]:
        """Ray Data's `map_batches` protocol: an `image` column (HxWx3 uint8 arrays, as
        `ray.data.read_images(mode="RGB")` gives them) or a `path` column of image files (read
        here: an unreadable one is a bad row, not a failed job), and the prompt as keywords
        (`map_batches(fn_kwargs=...)`), or `everything` for the automatic generator; other columns
        pass through. Out: the batch with `masks` (a JSON list per image, of each mask's record
        with its uncompressed RLE under `segmentation`, as `genfast segment --json` writes them),
        `num_masks` and `error` (the reason an image could not be segmented, e.g. the prompt is
        outside it): one bad image does not fail the batch."""
        prompt = None if everything else make_prompt(points, labels, box)
        column = batch.get("image", batch.get("path"))
        if column is None:
            raise UserError("the batch has no `image` or `path` column (images, or their files)")
        count = len(column)
        masks: list[str | None] = [None] * count
        errors: list[str | None] = [None] * count
        good: list[int] = []
        arrays: list[np.ndarray] = []
        for index in range(count):
            try:
                image = _image_array(column[index])
                if prompt is not None:
                    check_prompt_inside(prompt, *image.shape[:2])
            except UserError as e:
                errors[index] = str(e)
                continue
            good.append(index)
            arrays.append(image)
        results = self.segment_everything(arrays) if everything else self._in_batches(arrays, prompt, multimask)
        for index, result in zip(good, results, strict=True):
            masks[index] = masks_json(result)
        return {
            **batch,
            "masks": np.array(masks, dtype=object),
            "num_masks": np.array([0 if m is None else len(json.loads(m)) for m in masks]),
            "error": np.array(errors, dtype=object),
        }

    def _in_batches(self, arrays: list[np.ndarray], prompt: Prompt, multimask: bool) -> list[Segmentation]:
        """The prompt's masks on each image, `batch_size` images per encoder call."""
        results: list[Segmentation] = []
        for start in range(0, len(arrays), self.batch_size):
            results += segment_prompts(self.model, arrays[start : start + self.batch_size], prompt, multimask)
        return results

    def __getstate__(self) -> dict[str, Any]:
        return dict(self._arguments)

    def __setstate__(self, arguments: dict[str, Any]) -> None:
        self.__init__(**arguments)  # type: ignore[misc]


def make_prompt(
    points: Sequence[Sequence[float]] | None, labels: Sequence[int] | None, box: Sequence[float] | None
) -> Prompt:
    """A prompt from Python values, checked as the command checks its flags."""
    point_texts = [_numbers_text(p) for p in points or ()]
    flags = argparse.Namespace(
        auto=False,
        multimask=False,
        point=point_texts,
        label=[str(int(v)) for v in labels] if labels is not None else [],
        box=[_numbers_text(box)] if box is not None else [],
    )
    return parse_prompt(flags)


def _numbers_text(values: Sequence[float]) -> str:
    return ",".join(str(float(v)) for v in values)


def _per_prompt_text(value: int | Sequence[int]) -> list[str]:
    """An `object_id` or `frame` argument as the command's repeated flag values."""
    values = [value] if isinstance(value, (int, np.integer)) else list(value)
    return [str(int(v)) if isinstance(v, (int, np.integer)) and v >= 0 else repr(v) for v in values]


def masks_json(result: Segmentation) -> str:
    """A result's records, each with its mask as uncompressed RLE, as one JSON list."""
    return json.dumps(records_with_masks(result), separators=(",", ":"))


def _images(images: ImageInput | Sequence[ImageInput]) -> list[np.ndarray]:
    single = isinstance(images, (str, Path)) or (isinstance(images, np.ndarray) and images.ndim == 3)
    batch = [images] if single else list(images)  # type: ignore[list-item]
    arrays = []
    for index, image in enumerate(batch):
        try:
            arrays.append(_image_array(image))
        except UserError as e:
            raise UserError(f"image {index}: {e}") from e
    return arrays


def _image_array(image: ImageInput) -> np.ndarray:
    """An image as HxWx3 uint8 RGB: a file read, or an array checked."""
    if isinstance(image, (str, Path, np.str_)):
        return load_image(str(image))
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise UserError(f"an image must be HxWx3 uint8 RGB, got an array of shape {array.shape} and {array.dtype}")
    # torch warns on read-only arrays (e.g. np.asarray of a PIL image), which the encoder takes as tensors.
    return array if array.flags.writeable else array.copy()
