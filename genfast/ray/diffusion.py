"""A file of prompts on a Ray cluster: the same PNGs as `genfast imagine --prompts`, drawn by
`genfast.ImageGenerator` actors.

The prompts are read here, with the single-process command's reader (the same ids, seeds and
bad items), and those whose PNG is not in OUTDIR yet go to the cluster as rows; each actor loads
the pipeline once and draws `batch_size` rows a call. The images come back to this process, which
writes each PNG into OUTDIR atomically as its batch arrives: OUTDIR is a folder of this machine,
whatever the nodes share, and a stop leaves only whole PNGs, which a re-run skips. A killed actor
is restarted and its rows drawn again (Ray Data's defaults for actor pools).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from genfast.diffusion.prompts_file import PromptItem, check_file_flags, items_to_draw
from genfast.errors import UserError
from genfast.interface.batch import Summary
from genfast.ray.cluster import connect, leaving_ray, map_through


def imagine_folder(
    prompts_path: str | Path,
    output_dir: str | Path,
    generator: dict[str, Any],
    *,
    base_seed: int = 0,
    force: bool = False,
    address: str | None = None,
    concurrency: int = 1,
    cpus_per_actor: float = 1,
    stream: TextIO | None = None,
) -> Summary:
    """Draw every item of `prompts_path` whose PNG is not in `output_dir` (all with `force`) with
    `concurrency` actors, each a `genfast.ImageGenerator(**generator)` reserving `cpus_per_actor`
    CPUs, `generator["batch_size"]` rows a call."""
    from PIL import Image

    from genfast.diffusion.generator import ImageGenerator
    from genfast.diffusion.prompts_file import write_image
    from genfast.interface.progress import Progress

    stream = stream if stream is not None else sys.stderr
    source, outdir = Path(prompts_path).expanduser(), Path(output_dir).expanduser()
    summary = Summary()
    todo = items_to_draw(source, outdir, base_seed, force, summary, stream)
    if not todo:
        return summary
    ray = connect(address)
    rows = ray.data.from_items([item.row() for item in todo])
    drawn = map_through(ray, rows, ImageGenerator, generator, {}, concurrency, generator.get("batch_size", 1),
                        cpus_per_actor)  # fmt: skip
    outdir.mkdir(parents=True, exist_ok=True)
    by_line = {item.line: item for item in todo}
    progress = Progress(len(todo), "images", stream)
    try:
        for batch in drawn.iter_batches(batch_size=None, batch_format="numpy"):
            for index, line in enumerate(batch["line"]):
                item: PromptItem = by_line[int(line)]
                error, warning = _text(batch["error"][index]), _text(batch["warning"][index])
                if error is not None:
                    summary.fail(f"line {item.line}: id {item.id!r}: {error}", stream)
                else:
                    if warning is not None:
                        print(
                            f"genfast: warning: line {item.line}: id {item.id!r}: the prompt is {warning}", file=stream
                        )
                    text = json.loads(batch["settings"][index])
                    write_image(outdir, item, Image.fromarray(batch["image"][index]), text)
                    summary.done += 1
                progress.advance()
    finally:
        progress.finish()
    return summary


def _text(value: Any) -> str | None:
    """A text column's value; None where it is missing (a column of nulls comes back as NaN)."""
    return value if isinstance(value, str) else None


def imagine_command(args: argparse.Namespace) -> int:
    """`genfast imagine --prompts F -o OUTDIR --ray [ADDRESS]`: the file on the cluster. Exit
    status 1 when an item was left out."""
    from genfast.diffusion.commands import generator_arguments

    if args.prompts is None:
        raise UserError("--ray draws a file of prompts: give --prompts FILE")
    source, outdir = check_file_flags(args)
    generator = generator_arguments(args)
    generator["threads"] = args.threads or args.cpus_per_actor
    with leaving_ray():
        summary = imagine_folder(
            source, outdir, generator, base_seed=args.seed or 0, force=args.force, address=args.ray,
            concurrency=args.actors, cpus_per_actor=args.cpus_per_actor,
        )  # fmt: skip
    print(f"genfast: {summary.line()} on Ray; images in {outdir}", file=sys.stderr, flush=True)
    return 1 if summary.failed else 0
