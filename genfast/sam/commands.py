"""`genfast segment`: Segment Anything on one image from the command line.

    genfast pull sam-vit-b                                    # the official checkpoint (375 MB)
    genfast segment photo.jpg --point 320,240 -o mask.png     # best of SAM's 3 masks for one click
    genfast segment photo.jpg --point 320,240 --point 400,260 --label 1 --label 0 -o mask.png
    genfast segment photo.jpg --box 100,80,500,400 --multimask -o mask.png --json masks.json
    genfast segment photo.jpg --auto -o labels.png --json masks.json     # every object
    genfast segment photo.jpg --point 320,240 --checkpoint ~/sam_vit_h_4b8939.pth -o mask.png

Outputs (none is overwritten without --force; all are written atomically, all or nothing):
  -o OUT.png       prompts: the best-scoring mask, 8-bit grayscale 0/255; with --multimask the
                   k-th best mask goes to OUT-k.png (k = 2, 3). --auto: a label map, 0 background
                   and i for the i-th mask by decreasing area (smaller masks drawn on top); 8-bit,
                   or 16-bit beyond 255 masks.
  OUT-overlay.png  the image with the masks tinted and outlined and the prompt drawn
                   (--overlay PATH elsewhere, --no-overlay none).
  --json PATH      masks as uncompressed RLE (COCO's {"size": [H, W], "counts": [...]}, column
                   major, starting with a run of zeros) with scores, areas and XYWH boxes
                   ('-' = stdout).
Coordinates are pixels of the image as displayed (EXIF orientation applied), x to the right
and y down. --random-weights is for benchmarking only: every output says so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genfast import __version__
from genfast.errors import UserError
from genfast.interface import images as image_files
from genfast.interface.startup import since_launch
from genfast.platform.hardware import synchronize
from genfast.sam import images
from genfast.sam.masks import box_xyxy_to_xywh, mask_to_rle, masks_to_boxes
from genfast.sam.modeling import Sam
from genfast.sam.sam2.config import Sam2Config
from genfast.sam.sam2.modeling.model import Sam2
from genfast.storage.files import check_outputs

RANDOM_WEIGHTS_WARNING = "random weights (--random-weights): for benchmarking only; these masks are meaningless"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- prompts -------------------------------------------------------------------------------------


@dataclass
class Prompt:
    points: np.ndarray | None = None  # [N, 2] (x, y)
    labels: np.ndarray | None = None  # [N] 1 foreground / 0 background
    box: np.ndarray | None = None  # [4] x0, y0, x1, y1
    texts: dict[str, list[str]] = field(default_factory=dict)  # as typed, for error messages

    def as_json(self) -> dict[str, Any]:
        return {
            "points": None if self.points is None else self.points.tolist(),
            "labels": None if self.labels is None else self.labels.tolist(),
            "box": None if self.box is None else self.box.tolist(),
        }


def _numbers(text: str, count: int, flag: str, form: str) -> list[float]:
    parts = text.split(",")
    try:
        values = [float(p) for p in parts] if len(parts) == count else None
    except ValueError:
        values = None
    if values is None or not all(math.isfinite(v) for v in values):
        raise UserError(f"{flag} expects {form} ({count} numbers separated by commas, no spaces), got {text!r}")
    return values


def parse_prompt(args: argparse.Namespace) -> Prompt:
    """Check the prompt flags' text and combination (before anything slow runs)."""
    points, labels, boxes = args.point or [], args.label or [], args.box or []
    if args.auto:
        if points or labels or boxes:
            raise UserError("--auto segments everything by itself: drop --point/--label/--box, or drop --auto")
        if args.multimask:
            raise UserError("--multimask applies to --point/--box prompts, not to --auto")
        return Prompt()
    if not points and not boxes:
        raise UserError(
            "no prompt given: pass --point X,Y (repeatable) and/or --box X0,Y0,X1,Y1, or --auto to segment everything"
        )
    if labels and len(labels) != len(points):
        raise UserError(
            f"got {len(labels)} --label for {len(points)} --point; give one label per point "
            "(1 foreground, 0 background) or none (all foreground)"
        )
    if len(boxes) > 1:
        raise UserError(f"got {len(boxes)} --box; SAM takes one box per prompt")
    for text in labels:
        if text not in ("0", "1"):
            raise UserError(f"--label must be 1 (foreground) or 0 (background), got {text!r}")
    prompt = Prompt(texts={"--point": points, "--box": boxes})
    if points:
        prompt.points = np.array([_numbers(p, 2, "--point", "X,Y") for p in points], dtype=np.float64)
        prompt.labels = np.array([int(v) for v in labels] if labels else [1] * len(points), dtype=np.int64)
    if boxes:
        box = _numbers(boxes[0], 4, "--box", "X0,Y0,X1,Y1")
        if not (box[0] < box[2] and box[1] < box[3]):
            raise UserError(
                f"--box {boxes[0]} must be X0,Y0,X1,Y1 with X0 < X1 and Y0 < Y1 (top-left, then bottom-right)"
            )
        prompt.box = np.array(box, dtype=np.float64)
    return prompt


def check_prompt_inside(prompt: Prompt, height: int, width: int) -> None:
    where = f"the image is {width}x{height} pixels: x must be in 0..{width}, y in 0..{height}"
    if prompt.points is not None:
        for text, (x, y) in zip(prompt.texts["--point"], prompt.points):
            if not (0 <= x <= width and 0 <= y <= height):
                raise UserError(f"--point {text} is outside the image ({where})")
    if prompt.box is not None:
        x0, y0, x1, y1 = prompt.box
        if not (x0 >= 0 and x1 <= width and y0 >= 0 and y1 <= height):
            raise UserError(f"--box {prompt.texts['--box'][0]} is outside the image ({where})")


# ---- model ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSource:
    """What a result's files say about the model that made it (PNG metadata, JSON fields): all a
    writer needs of the model, so one that is not the process holding the model (Ray's driver)
    can write the same files."""

    description: str  # e.g. "vit_b from /path/sam_vit_b_01ec64.pth"
    checkpoint: Path | None  # None with random weights
    random_weights: bool


@dataclass
class LoadedSam:
    model: Sam | Sam2
    description: str  # e.g. "vit_b from /path/sam_vit_b_01ec64.pth"
    checkpoint: Path | None  # None with random weights
    random_weights: bool

    @property
    def source(self) -> ModelSource:
        return ModelSource(self.description, self.checkpoint, self.random_weights)


def load_model(args: argparse.Namespace, device: torch.device) -> LoadedSam:
    """The model --checkpoint, --model and --random-weights name (SAM or SAM 2, told apart by the
    name or the file's contents), in float32 on `device`."""
    from genfast.sam.build import build_random_sam, read_checkpoint_file, sam_from_state_dict
    from genfast.sam.config import sam_preset
    from genfast.sam.sam2 import build as sam2_build
    from genfast.sam.sam2.config import sam2_preset
    from genfast.storage.hub import (
        DEFAULT_SAM_MODEL,
        SAM2_CHECKPOINTS,
        SAM_CHECKPOINTS,
        resolve_sam2_checkpoint,
        resolve_sam_checkpoint,
        sam2_model_name,
        sam_model_name,
    )

    if args.checkpoint and args.model:
        raise UserError("give --checkpoint PATH or --model NAME, not both")
    name = args.model or (None if args.checkpoint else DEFAULT_SAM_MODEL)
    sam2_name = sam2_model_name(name) if name else None
    if name and sam2_name is None and sam_model_name(name) is None and not Path(name).expanduser().exists():
        raise UserError(
            f"unknown SAM model {name!r}; use one of {', '.join([*SAM_CHECKPOINTS, *SAM2_CHECKPOINTS])} "
            "(or --checkpoint PATH)"
        )
    checkpoint = None
    if args.checkpoint or not args.random_weights:
        if args.checkpoint:
            checkpoint = Path(args.checkpoint).expanduser()
        else:
            checkpoint = resolve_sam2_checkpoint(name) if sam2_name else resolve_sam_checkpoint(name)
    if checkpoint is not None and (checkpoint.is_dir() or checkpoint.suffix == ".safetensors"):
        model: Sam | Sam2 = sam2_build.load_sam2_checkpoint(checkpoint)  # Hugging Face's layout: SAM 2 only
    elif checkpoint is not None:
        hint = "download an official checkpoint (`genfast pull NAME`) or pass the right path"
        loaded = read_checkpoint_file(checkpoint, "SAM", hint)
        if sam2_build.is_sam2_checkpoint(loaded):
            model = sam2_build.sam2_from_checkpoint(loaded, checkpoint, sam2_preset(sam2_name) if sam2_name else None)
        elif isinstance(loaded, dict) and "model" not in loaded:
            model = sam_from_state_dict(loaded, str(checkpoint))
        else:
            raise UserError(
                f"{str(checkpoint)!r} is not a SAM or SAM 2 checkpoint (an official sam_vit_*.pth or sam2*_hiera_*.pt)"
            )
    if args.random_weights:
        # Only the architecture is taken from a checkpoint; no weights are used.
        if checkpoint is not None:
            config, source = model.config, f"the architecture of {checkpoint}"
        elif sam2_name:
            config, source = sam2_preset(sam2_name), sam2_name
        else:
            sam_name = sam_model_name(name)
            config, source = sam_preset(sam_name.removeprefix("sam-").replace("-", "_")), sam_name
        model = sam2_build.build_random_sam2(config) if isinstance(config, Sam2Config) else build_random_sam(config)
        description = f"{config.name} with RANDOM weights ({source})"
        checkpoint = None
    else:
        description = f"{model.config.name} from {checkpoint}"
    model = model.to(device=device)
    if isinstance(model, Sam):
        model.reset_pixel_stats()  # keep the (non-persistent) pixel statistics in float32
    return LoadedSam(model, description, checkpoint, bool(args.random_weights))


# ---- masks ---------------------------------------------------------------------------------------


@dataclass
class Segmentation:
    masks: list[np.ndarray]  # bool HxW, in output order
    records: list[dict[str, Any]]  # one JSON record per mask (without the RLE)
    encode_s: float
    decode_s: float
    called_s: float = 0.0  # when the encoder was called, in seconds since launch (genfast.interface.startup)


def segment_prompts(model: Sam | Sam2, images: list[np.ndarray], prompt: Prompt, multimask: bool) -> list[Segmentation]:
    """SAM's three masks for the prompt on each image, best predicted IoU first (only the best
    without `multimask`); the images go through the encoder in one call."""
    from genfast.sam.predictor import SamPredictor
    from genfast.sam.sam2.predictor import SAM2ImagePredictor

    n = len(images)
    called, start = since_launch(), time.perf_counter()
    predictor = SAM2ImagePredictor(model) if isinstance(model, Sam2) else SamPredictor(model)
    if isinstance(predictor, SAM2ImagePredictor):
        predictor.set_image_batch(images)
    else:
        predictor.set_images(images)
    synchronize(model.device)
    encode_s = (time.perf_counter() - start) / n  # the batch's encoder time, shared
    start = time.perf_counter()
    if isinstance(predictor, SAM2ImagePredictor):
        masks, scores, _ = predictor.predict_batch(
            [prompt.points] * n, [prompt.labels] * n, [prompt.box] * n, multimask_output=True
        )
    else:
        outputs = [
            predictor.predict(prompt.points, prompt.labels, prompt.box, multimask_output=True, image_index=i)
            for i in range(n)
        ]
        masks, scores = [o[0] for o in outputs], [o[1] for o in outputs]
    decode_s = (time.perf_counter() - start) / n
    return [_ranked(m, sc, multimask, encode_s, decode_s, called) for m, sc in zip(masks, scores, strict=True)]


def _ranked(
    masks: np.ndarray, scores: np.ndarray, multimask: bool, encode_s: float, decode_s: float, called: float
) -> Segmentation:
    order = np.argsort(-scores, kind="stable")[: len(scores) if multimask else 1]
    kept = [masks[i] for i in order]
    boxes = box_xyxy_to_xywh(masks_to_boxes(torch.from_numpy(masks[order]))).tolist()  # the original's XYWH
    records = [
        {"rank": rank + 1, "predicted_iou": float(scores[i]), "area": int(masks[i].sum()), "bbox": box}
        for rank, (i, box) in enumerate(zip(order, boxes))
    ]
    return Segmentation(kept, records, encode_s, decode_s, called)


def segment_auto(model: Sam | Sam2, image: np.ndarray, args: argparse.Namespace) -> Segmentation:
    """Every object: the model's automatic mask generator, masks by decreasing area."""
    from genfast.sam.automatic import SamAutomaticMaskGenerator
    from genfast.sam.sam2.automatic import SAM2AutomaticMaskGenerator

    kind = SAM2AutomaticMaskGenerator if isinstance(model, Sam2) else SamAutomaticMaskGenerator
    generator = kind(
        model,
        points_per_side=args.points_per_side,
        points_per_batch=args.points_per_batch,
        pred_iou_thresh=pred_iou_thresh(args, model),
        stability_score_thresh=args.stability_score_thresh,
        output_mode="binary_mask",
    )
    called, start = since_launch(), time.perf_counter()
    found = generator.generate(image)
    synchronize(model.device)
    elapsed = time.perf_counter() - start
    found = sorted(found, key=lambda r: r["area"], reverse=True)
    masks = [np.asarray(r["segmentation"], dtype=bool) for r in found]
    records = [
        {"label": i + 1, **{k: _plain(v) for k, v in r.items() if k != "segmentation"}} for i, r in enumerate(found)
    ]
    return Segmentation(masks, records, 0.0, elapsed, called)


def pred_iou_thresh(args: argparse.Namespace, model: Sam | Sam2) -> float:
    """--pred-iou-thresh, or the official generator's default for the model (SAM 0.88, SAM 2 0.8)."""
    if args.pred_iou_thresh is not None:
        return args.pred_iou_thresh
    return 0.8 if isinstance(model, Sam2) else 0.88


def _plain(value: Any) -> Any:
    """numpy/torch scalars and arrays as JSON-ready Python values."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---- the command ---------------------------------------------------------------------------------


@dataclass
class OutputPaths:
    masks: list[Path]  # -o and, with --multimask, OUT-2.png, OUT-3.png
    overlay: Path | None
    json: Path | None  # None: no JSON, or stdout
    json_stdout: bool = False

    def files(self) -> list[Path]:
        return [*self.masks, *([self.overlay] if self.overlay else []), *([self.json] if self.json else [])]


def _output_paths(args: argparse.Namespace, multimask_outputs: int) -> OutputPaths:
    if not (args.output or args.json_path or args.overlay):
        raise UserError("nothing to write: give -o OUT.png (mask and overlay) and/or --json PATH")
    if args.no_overlay and args.overlay:
        raise UserError("give --overlay PATH or --no-overlay, not both")
    masks, overlay = [], None
    if args.output:
        out = Path(args.output).expanduser()
        suffix = out.suffix or ".png"
        masks = [out] + [out.with_name(f"{out.stem}-{k}{suffix}") for k in range(2, multimask_outputs + 1)]
        if not args.no_overlay:
            overlay = Path(args.overlay).expanduser() if args.overlay else out.with_name(f"{out.stem}-overlay{suffix}")
    elif args.overlay:
        overlay = Path(args.overlay).expanduser()
    image_files.check_png_names([*masks, *([overlay] if overlay else [])])
    json_stdout = args.json_path == "-"
    json_path = Path(args.json_path).expanduser() if args.json_path and not json_stdout else None
    return OutputPaths(masks, overlay, json_path, json_stdout)


def segment_command(args: argparse.Namespace) -> int:
    from genfast.platform.hardware import resolve_device

    for flag in ("object", "frame"):
        if getattr(args, flag, None):
            raise UserError(f"--{flag} is for videos (SAM 2 tracking); {args.image} is an image")
    prompt = parse_prompt(args)
    device = resolve_device(args.device)
    multimask_outputs = 3 if args.multimask else 1  # every SAM checkpoint makes 3 (checked below)
    paths = _output_paths(args, multimask_outputs)
    check_outputs(paths.files(), args.force, inputs=[args.image, args.checkpoint])  # before the slow part
    image = image_files.load_image(args.image)
    height, width = image.shape[:2]
    check_prompt_inside(prompt, height, width)
    loaded = prepare_model(args, device)  # after the input checks: this is the slow part
    outputs = getattr(loaded.model.config, "num_multimask_outputs", 3)  # SAM 2 always makes 3
    if args.multimask and outputs != multimask_outputs:
        paths = _output_paths(args, outputs)

    if args.auto:
        args.pred_iou_thresh = pred_iou_thresh(args, loaded.model)  # the summary names the one used
        result = segment_auto(loaded.model, image, args)
    else:
        [result] = segment_prompts(loaded.model, [image], prompt, args.multimask)
    files, document = output_files(args, loaded.source, Path(args.image), image, prompt, result, paths)
    image_files.write_files(files, args.force)
    if paths.json_stdout:
        sys.stdout.write(json.dumps(document, separators=(",", ":")) + "\n")
        sys.stdout.flush()

    _log(_summary(args, result, (height, width), list(files)))
    if loaded.random_weights:
        _log(f"genfast: WARNING: {RANDOM_WEIGHTS_WARNING}")
    return 0


def prepare_model(args: argparse.Namespace, device: torch.device) -> LoadedSam:
    """The model the flags name, on `device`, run as --recipe says; says so on stderr."""
    from genfast.platform.hardware import dtype_name
    from genfast.platform.threads import avoid_busy_cores, use_threads
    from genfast.recipe import Target
    from genfast.sam.recipe import RECIPE, apply_recipe

    # Planning may build a native kernel (seconds on first use): after the callers' input checks.
    plan = RECIPE.plan(args.recipe, Target(device, dtype_name(args.dtype)))
    other_work = use_threads(args.threads)
    loaded = load_model(args, device)
    if other_work is not None and device.type == "cpu":
        avoid_busy_cores(other_work, _log)
    apply_recipe(loaded.model, plan.settings)
    if loaded.random_weights:
        _log(f"genfast: WARNING: {RANDOM_WEIGHTS_WARNING}")
    _log(f"genfast: SAM {loaded.description} | recipe {args.recipe} in {plan.settings.dtype} on {device}")
    for message in plan.messages():
        _log(f"genfast: {message}")
    return loaded


def output_files(
    args: argparse.Namespace,
    source: ModelSource,
    image_path: Path,
    image: np.ndarray,
    prompt: Prompt,
    result: Segmentation,
    paths: OutputPaths,
) -> tuple[dict[Path, bytes], dict[str, Any] | None]:
    """The files one image's result makes (mask or label PNGs, overlay, JSON), and the JSON
    document (None without --json)."""
    size = image.shape[:2]
    if args.auto:
        mask_images = [images.label_image(result.masks, size)] if paths.masks else []
        overlay_masks, colours = result.masks, [images.colour(i) for i in range(len(result.masks))]
    else:
        mask_images = [images.mask_image(m) for m in result.masks][: len(paths.masks)]
        # Best mask drawn last, on top.
        overlay_masks = result.masks[::-1]
        colours = [images.colour(i) for i in range(len(result.masks))][::-1]
        for record, path in zip(result.records, paths.masks):
            record["file"] = str(path)
    text = _png_text(source, image_path)
    files: dict[Path, bytes] = {path: image_files.png_bytes(img, text) for path, img in zip(paths.masks, mask_images)}
    if paths.overlay:
        overlay = images.overlay_image(image, overlay_masks, colours, prompt.points, prompt.labels, prompt.box)
        files[paths.overlay] = image_files.png_bytes(overlay, text)
    wanted = paths.json is not None or paths.json_stdout
    document = _json_document(args, source, image_path, prompt, result, size, paths) if wanted else None
    if paths.json:
        files[paths.json] = (json.dumps(document, separators=(",", ":")) + "\n").encode()
    return files, document


def _png_text(source: ModelSource, image_path: Path) -> dict[str, str]:
    text = {
        "Software": f"genfast {__version__}",
        "genfast:model": source.description,
        "genfast:image": str(image_path),
        "genfast:random-weights": str(source.random_weights).lower(),
    }
    if source.random_weights:
        text["Warning"] = RANDOM_WEIGHTS_WARNING
    return text


def _json_document(
    args: argparse.Namespace,
    source: ModelSource,
    image_path: Path,
    prompt: Prompt,
    result: Segmentation,
    size: tuple[int, int],
    paths: OutputPaths,
) -> dict[str, Any]:
    document: dict[str, Any] = {
        "genfast_version": __version__,
        "random_weights": source.random_weights,
    }
    if source.random_weights:
        document["warning"] = RANDOM_WEIGHTS_WARNING
    document.update(
        {
            "image": str(image_path),
            "image_size": list(size),  # [height, width]
            "model": source.description,
            "checkpoint": str(source.checkpoint) if source.checkpoint else None,
            "mode": "auto" if args.auto else "prompt",
            "prompt": None if args.auto else prompt.as_json(),
            "mask_files": [str(p) for p in paths.masks],  # --auto: the label map
            "overlay_file": str(paths.overlay) if paths.overlay else None,
            "masks": records_with_masks(result),
        }
    )
    return document


def records_with_masks(result: Segmentation) -> list[dict[str, Any]]:
    """The result's records, each with its mask as uncompressed RLE under `segmentation`."""
    rles = mask_to_rle(torch.from_numpy(np.stack(result.masks))) if result.masks else []
    return [{**record, "segmentation": rle} for record, rle in zip(result.records, rles, strict=True)]


def _summary(args: argparse.Namespace, result: Segmentation, size: tuple[int, int], written: list[Path]) -> str:
    height, width = size
    n = len(result.masks)
    if args.auto:
        timing = f"{n} mask{'s' * (n != 1)} in {result.decode_s:.2f} s (automatic, {args.points_per_side}^2 points)"
        if n == 0:
            timing += (
                f"; none passed --pred-iou-thresh {args.pred_iou_thresh} and "
                f"--stability-score-thresh {args.stability_score_thresh}"
            )
    else:
        best = result.records[0]
        timing = (
            f"encoder {result.encode_s:.2f} s, decoder {result.decode_s * 1e3:.0f} ms | best mask: "
            f"predicted IoU {best['predicted_iou']:.3f}, {best['area']} px"
        )
    outputs = ", ".join(str(p) for p in written) + (", JSON on stdout" if args.json_path == "-" else "")
    start_up = f"genfast: start-up: the model was first called {result.called_s:.1f} s after launch"
    return f"genfast: {width}x{height} image | {timing}\n{start_up}\ngenfast: wrote {outputs}"
