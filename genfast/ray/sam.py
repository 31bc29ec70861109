"""Many images on a Ray cluster: image files in, a folder of JSONL masks out, through `genfast.Segmenter`.

Each row names an image file (`path`) and gets its masks for the prompt (or every object's) as
`genfast segment --json` writes them: a JSON list of records (predicted IoU, area, XYWH box) with
each mask as uncompressed RLE under `segmentation`; `num_masks`; and `error`, the reason an image
could not be segmented (unreadable, the prompt outside it), its masks then null. The files are
read by the actors, so a bad file is a bad row, not a failed job. Ray Data writes one JSONL file
per block into the output folder, in no particular order: join on `path`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from genfast.errors import UserError
from genfast.ray.cluster import connect, map_through, write_jsonl


def segment_images(
    images: Sequence[str | Path],
    output_dir: str | Path,
    segmenter: dict[str, Any],
    *,
    prompt: dict[str, Any] | None = None,
    address: str | None = None,
    concurrency: int = 1,
    batch_size: int = 4,
    cpus_per_actor: float = 1,
) -> int:
    """Segment every image file with `concurrency` actors, each a `genfast.Segmenter(**segmenter)`
    reserving `cpus_per_actor` CPUs, `batch_size` images per call. `prompt`: `Segmenter.__call__`'s
    keywords (`points`, `labels`, `box`, `multimask`, or `everything=True`). Returns the rows written."""
    from genfast.sam.segmenter import Segmenter

    target = Path(output_dir).expanduser()
    if not images:
        raise UserError("no images to segment")
    if target.exists() and any(target.iterdir()):
        raise UserError(f"{target} is not empty: give an empty or new folder for the masks")
    ray = connect(address)
    # The rows are paths: the actors read the files.
    rows = ray.data.from_items([{"path": str(Path(p).expanduser().resolve())} for p in images])
    mapped = map_through(ray, rows, Segmenter, segmenter, prompt or {}, concurrency, batch_size, cpus_per_actor)
    return write_jsonl(mapped, target)


def segment_command(args: argparse.Namespace) -> int:
    """`genfast segment DIR_OR_GLOB -o OUTDIR --ray [ADDRESS]`: the images on the cluster."""
    from genfast.sam.batch_command import image_paths
    from genfast.sam.commands import parse_prompt

    if args.output is None:
        raise UserError("--ray needs -o OUTDIR: an empty or new folder for the JSONL rows")
    for flag, given in (("--json", args.json_path), ("--overlay", args.overlay), ("--video", args.video)):
        if given:
            raise UserError(f"{flag} does not apply with --ray, which writes JSONL rows of masks for many images")
    source = Path(args.image).expanduser()
    if source.is_file():
        raise UserError(f"--ray is for many images (a folder or a glob pattern); {args.image} is one file")
    prompt = parse_prompt(args)
    if args.auto:
        keywords: dict[str, Any] = {"everything": True}
    else:
        keywords = {"multimask": args.multimask}
        if prompt.points is not None:
            keywords.update(points=prompt.points.tolist(), labels=prompt.labels.tolist())
        if prompt.box is not None:
            keywords["box"] = prompt.box.tolist()
    segmenter = dict(
        model=args.model, checkpoint=args.checkpoint, random_weights=args.random_weights, recipe=args.recipe,
        dtype=args.dtype, device=args.device, threads=args.threads or args.cpus_per_actor,
        batch_size=args.batch_size, points_per_side=args.points_per_side, points_per_batch=args.points_per_batch,
        pred_iou_thresh=args.pred_iou_thresh, stability_score_thresh=args.stability_score_thresh,
    )  # fmt: skip
    rows = segment_images(
        image_paths(args.image), args.output, segmenter, prompt=keywords, address=args.ray,
        concurrency=args.actors, batch_size=args.batch_size, cpus_per_actor=args.cpus_per_actor,
    )  # fmt: skip
    where = f"rows in {args.output}/ (rows with an error say why)"
    print(f"genfast: {rows} images segmented on Ray; {where}", file=sys.stderr)
    return 0
