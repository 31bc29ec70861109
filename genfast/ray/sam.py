"""Many images on a Ray cluster, through `genfast.Segmenter` actors.

`segment_folder` is `genfast segment DIR_OR_GLOB -o OUTDIR --ray`: the files a single machine
writes for each image (genfast/sam/batch_command.py), written by this process as the masks
arrive, resumed by a re-run. `segment_images` is the plain Ray Data pipeline for clusters whose
output goes to shared storage: each row names an image file (`path`) and gets its masks for the
prompt (or every object's) as `genfast segment --json` writes them: a JSON list of records
(predicted IoU, area, XYWH box) with each mask as uncompressed RLE under `segmentation`;
`num_masks`; and `error`, the reason an image could not be segmented (unreadable, the prompt
outside it), its masks then null. The files are read by the actors, so a bad file is a bad row,
not a failed job. Ray Data writes one JSONL file per block into the output folder, in no
particular order: join on `path`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from genfast.errors import UserError
from genfast.interface.batch import Summary
from genfast.ray.cluster import connect, leaving_ray, map_through, write_jsonl
from genfast.sam.commands import ModelSource, Prompt, Segmentation
from genfast.sam.masks import rle_to_mask
from genfast.sam.segmenter import Segmenter


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


class FileSegmenter(Segmenter):
    """`genfast.Segmenter` for `genfast segment DIR -o OUTDIR --ray`: its rows also carry `source`,
    what the command's files say about the model (description, checkpoint, random weights) as
    JSON, so that the driver writes them without loading the model itself."""

    def __call__(self, batch: dict[str, Any], **prompt: Any) -> dict[str, Any]:
        out = super().__call__(batch, **prompt)
        source = self.loaded.source
        text = json.dumps({"description": source.description, "random_weights": source.random_weights,
                           "checkpoint": None if source.checkpoint is None else str(source.checkpoint)})  # fmt: skip
        return {**out, "source": np.array([text] * len(out["error"]), dtype=object)}


def segment_folder(args: argparse.Namespace, stream: TextIO | None = None) -> Summary:
    """`genfast segment DIR_OR_GLOB -o OUTDIR` on the cluster: the files the single-machine command
    writes (genfast/sam/batch_command.py), resumed by a re-run alike.

    The images to do are chosen here, as on one machine; their paths go to `--actors` actors of
    `FileSegmenter` as rows, which read and segment them and send back each one's masks (as RLE)
    and records, or why it could not be segmented. This process writes each image's files
    atomically as its batch arrives, reading the image again for its overlay: OUTDIR is a folder
    of this machine, and a stop leaves only whole images' files, which a re-run skips. A killed
    actor is restarted and its rows run again (Ray Data's defaults for actor pools)."""
    from genfast.interface.images import load_image
    from genfast.interface.progress import Progress
    from genfast.sam.batch_command import images_to_segment, write_outputs

    stream = stream if stream is not None else sys.stderr
    summary = Summary()
    outdir, prompt, todo = images_to_segment(args, summary)
    if not todo:
        return summary
    keywords: dict[str, Any] = {"everything": True} if args.auto else _prompt_keywords(prompt, args.multimask)
    # The actors may run in another folder, or on another machine: files named by absolute paths.
    as_sent = {name: _absolute(getattr(args, name)) for name in ("model", "checkpoint")}
    ray = connect(args.ray)
    rows = ray.data.from_items([{"index": i, "path": str(p.expanduser().resolve())} for i, p in enumerate(todo)])
    results = map_through(ray, rows, FileSegmenter, _segmenter_arguments(args, as_sent), keywords, args.actors,
                          args.batch_size, args.cpus_per_actor)  # fmt: skip
    outdir.mkdir(parents=True, exist_ok=True)
    written: set[int] = set()
    progress = Progress(len(todo), "images", stream)
    try:
        for batch in results.iter_batches(batch_size=None, batch_format="numpy"):
            for row, index in enumerate(batch["index"]):
                path = todo[int(index)]
                if int(index) in written:  # a block run again after a lost worker: its files are there
                    continue
                written.add(int(index))
                error = batch["error"][row]
                try:
                    if isinstance(error, str):
                        raise UserError(error)
                    source = _source(json.loads(batch["source"][row]), args, as_sent)
                    image = load_image(path)
                    write_outputs(args, source, outdir, path, image, prompt, _segmentation(batch["masks"][row]))
                    summary.done += 1
                except UserError as e:
                    summary.fail(f"{path}: {e}", stream)
                progress.advance()
    finally:
        progress.finish()
    return summary


def _prompt_keywords(prompt: Prompt, multimask: bool) -> dict[str, Any]:
    """`Segmenter.__call__`'s keywords for the command's prompt."""
    keywords: dict[str, Any] = {"multimask": multimask}
    if prompt.points is not None:
        keywords.update(points=prompt.points.tolist(), labels=prompt.labels.tolist())
    if prompt.box is not None:
        keywords["box"] = prompt.box.tolist()
    return keywords


def _segmenter_arguments(args: argparse.Namespace, paths: dict[str, str | None]) -> dict[str, Any]:
    """`Segmenter`'s arguments for the command's flags, with `paths` for --model and --checkpoint."""
    return dict(
        model=paths["model"], checkpoint=paths["checkpoint"], random_weights=args.random_weights, recipe=args.recipe,
        dtype=args.dtype, device=args.device, threads=args.threads or args.cpus_per_actor,
        batch_size=args.batch_size, points_per_side=args.points_per_side, points_per_batch=args.points_per_batch,
        pred_iou_thresh=args.pred_iou_thresh, stability_score_thresh=args.stability_score_thresh,
    )  # fmt: skip


def _absolute(name: str | None) -> str | None:
    """A flag's value, absolute where it names a file or folder of this machine (else a model name)."""
    if name is None or not Path(name).expanduser().exists():
        return name
    return str(Path(name).expanduser().resolve())


def _source(reported: dict[str, Any], args: argparse.Namespace, as_sent: dict[str, str | None]) -> ModelSource:
    """The model's source as an actor reports it, with the files named as the user named them,
    as the single-machine command's outputs name them (the actors were sent absolute paths)."""
    description, checkpoint = reported["description"], reported["checkpoint"]
    for name, sent in as_sent.items():
        given = getattr(args, name)
        if sent is not None and sent != given:
            shown = str(Path(given).expanduser())
            description = description.replace(sent, shown)
            checkpoint = shown if checkpoint == sent else checkpoint
    return ModelSource(description, None if checkpoint is None else Path(checkpoint), reported["random_weights"])


def _segmentation(masks: str) -> Segmentation:
    """An image's result from `Segmenter.__call__`'s `masks` (its records with RLE masks)."""
    records = json.loads(masks)
    decoded = [rle_to_mask(record.pop("segmentation")).numpy() for record in records]
    return Segmentation(decoded, records, 0.0, 0.0)


def segment_command(args: argparse.Namespace) -> int:
    """`genfast segment DIR_OR_GLOB -o OUTDIR --ray [ADDRESS]`: the images on the cluster. Exit
    status 1 when an image was left out."""
    from genfast.sam.segment import input_kind

    # Decided as without --ray, before the cluster is joined.
    kind = input_kind(args)
    if kind == "video":
        raise UserError(
            f"{args.image} is a video (a video file or a folder of numbered frames): SAM 2 tracks objects "
            "frame after frame, in one process, so --ray does not apply; drop --ray (or pass --images to "
            "segment the frames as separate images)"
        )
    if kind == "image":
        raise UserError(f"--ray is for many images (a folder or a glob pattern); {args.image} is one file")
    with leaving_ray():
        summary = segment_folder(args)
    print(f"genfast: {summary.line()} on Ray; outputs in {args.output}", file=sys.stderr, flush=True)
    return 1 if summary.failed else 0
