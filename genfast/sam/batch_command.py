"""`genfast segment DIR_OR_GLOB -o OUTDIR`: many images, the same prompt (or --auto) on each.

    genfast segment 'photos/*.jpg' --point 320,240 -o masks/     # a glob (quoted: genfast expands it)
    genfast segment photos/ --auto -o masks/ --batch-size 4        # every image of a folder

Each image NAME.EXT gets OUTDIR/NAME.png (the best mask, or with --auto the label map),
OUTDIR/NAME-overlay.png (unless --no-overlay), with --multimask NAME-2.png and NAME-3.png, and
OUTDIR/NAME.json (the masks as RLE, as --json writes for one image). An image's files are written
together, atomically, as soon as it is done. A re-run skips the images whose files are all there;
an image with only some of them is left out unless --force says to redo it (nothing is
overwritten without --force). A bad image (unreadable, not an image, the prompt outside it) is
named and left out, and the others run. With a prompt, --batch-size images go through the image
encoder in one call.

A folder whose images are all named by frame numbers (00000.jpg, 00001.jpg ...), as SAM 2's
video tools write them, is a video's frames (genfast/sam/video_command.py); --images treats it as
separate images and --video any folder as frames.
"""

from __future__ import annotations

import argparse
import glob
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from genfast.errors import UserError
from genfast.interface import images as image_files
from genfast.interface.batch import Summary
from genfast.interface.progress import Progress
from genfast.sam.commands import (
    ModelSource,
    OutputPaths,
    Prompt,
    Segmentation,
    check_prompt_inside,
    output_files,
    parse_prompt,
    pred_iou_thresh,
    prepare_model,
    segment_auto,
    segment_prompts,
)
from genfast.sam.modeling import Sam
from genfast.sam.sam2.modeling.model import Sam2

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
GLOB_CHARACTERS = re.compile(r"[*?\[]")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def is_glob(text: str) -> bool:
    return bool(GLOB_CHARACTERS.search(text))


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))


def is_frame_folder(folder: Path) -> bool:
    """Whether a folder holds a video's frames: its images all named by integers (SAM 2's layout)."""
    frames = _images_in(folder)
    return bool(frames) and all(p.stem.isdigit() for p in frames)


def image_paths(source: str) -> list[Path]:
    """The images a glob pattern (`**` reaches into subfolders) or a folder holds, sorted."""
    if is_glob(source):
        matches = [Path(p) for p in glob.glob(str(Path(source).expanduser()), recursive=True)]
        paths = sorted(p for p in matches if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    else:
        folder = Path(source).expanduser()
        if not folder.is_dir():
            raise UserError(f"{source} is not a folder")
        paths = _images_in(folder)
    if not paths:
        raise UserError(f"no images match {source} (looked for {', '.join(IMAGE_SUFFIXES)})")
    return paths


def _outputs(image: Path, outdir: Path, args: argparse.Namespace) -> OutputPaths:
    stem = image.stem
    multimask_outputs = 3 if args.multimask else 1  # every SAM and SAM 2 model makes 3
    masks = [outdir / f"{stem}.png"] + [outdir / f"{stem}-{k}.png" for k in range(2, multimask_outputs + 1)]
    overlay = None if args.no_overlay else outdir / f"{stem}-overlay.png"
    return OutputPaths(masks, overlay, outdir / f"{stem}.json")


def _check_flags(args: argparse.Namespace) -> Path:
    if args.output is None:
        raise UserError("a batch of images needs -o OUTDIR: a folder for each image's masks, overlay and JSON")
    for flag, given in (("--json", args.json_path), ("--overlay", args.overlay)):
        if given:
            raise UserError(f"{flag} names one file; in a batch each image's go to OUTDIR/NAME.json, NAME-overlay.png")
    for flag in ("object", "frame"):
        if getattr(args, flag, None):
            raise UserError(f"--{flag} is for videos (SAM 2 tracking), not a batch of images")
    outdir = Path(args.output).expanduser()
    if outdir.exists() and not outdir.is_dir():
        raise UserError(f"-o {outdir} exists and is not a folder")
    return outdir


def _batches(items: list[Path], size: int) -> Iterator[list[Path]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def images_to_segment(args: argparse.Namespace, summary: Summary) -> tuple[Path, Prompt, list[Path]]:
    """The batch's flags checked before the slow load: the output folder, the prompt and the
    images to segment now. Those whose files are all there are counted as skipped, those with
    only some of them left out (unless --force); a killed run's temp files beside the outputs
    about to be written are removed."""
    outdir = _check_flags(args)
    prompt = parse_prompt(args)
    paths = image_paths(args.image)
    by_stem: dict[str, Path] = {}
    for path in paths:
        if path.stem in by_stem:
            raise UserError(f"{by_stem[path.stem]} and {path} would write the same OUTDIR/{path.stem}.png: rename one")
        by_stem[path.stem] = path
    todo = []
    for path in paths:
        files = _outputs(path, outdir, args).files()
        present = [f for f in files if f.exists()]
        if args.force or not present:
            todo.append(path)
            image_files.remove_stale_staging(files)  # a killed run's temp files beside them
        elif len(present) == len(files):
            summary.skipped += 1
        else:
            summary.fail(f"{path}: some of its outputs exist ({present[0].name}): remove them or pass --force")
    return outdir, prompt, todo


def write_outputs(
    args: argparse.Namespace,
    source: ModelSource,
    outdir: Path,
    path: Path,
    image: np.ndarray,
    prompt: Prompt,
    result: Segmentation,
) -> None:
    """One image's files (masks, overlay, JSON) in OUTDIR, together and atomically."""
    files, _ = output_files(args, source, path, image, prompt, result, _outputs(path, outdir, args))
    image_files.write_files(files, force=True)  # only this image's files, checked by images_to_segment


def segment_images_command(args: argparse.Namespace) -> int:
    from genfast.platform.hardware import resolve_device

    summary = Summary()
    outdir, prompt, todo = images_to_segment(args, summary)
    device = resolve_device(args.device)
    if not todo:
        _log(f"genfast: {summary.line()}")
        return 1 if summary.failed else 0

    loaded = prepare_model(args, device)
    if args.auto:
        args.pred_iou_thresh = pred_iou_thresh(args, loaded.model)
    outdir.mkdir(parents=True, exist_ok=True)
    progress = Progress(len(todo), "images")
    for batch in _batches(todo, 1 if args.auto else args.batch_size):
        readable: list[tuple[Path, np.ndarray]] = []
        for path in batch:
            try:
                image = image_files.load_image(str(path))
                if not args.auto:
                    check_prompt_inside(prompt, *image.shape[:2])
            except UserError as e:
                summary.fail(f"{path}: {e}")
                progress.advance()
                continue
            readable.append((path, image))
        if not readable:
            continue
        results = _segment(loaded.model, [image for _, image in readable], prompt, args)
        for (path, image), result in zip(readable, results, strict=True):
            write_outputs(args, loaded.source, outdir, path, image, prompt, result)
            summary.done += 1
            progress.advance()
    progress.finish()
    _log(f"genfast: {summary.line()}; outputs in {outdir}")
    return 1 if summary.failed else 0


def _segment(
    model: Sam | Sam2, images: list[np.ndarray], prompt: Prompt, args: argparse.Namespace
) -> list[Segmentation]:
    if args.auto:
        return [segment_auto(model, image, args) for image in images]
    return segment_prompts(model, images, prompt, args.multimask)
