"""`genfast imagine --prompts prompts.txt -o OUTDIR`: a file of prompts, a PNG each.

    genfast imagine --prompts prompts.txt -o images/ --model ./sdxl-turbo --denoising-steps 4 --seed 7

Input: a text file, one prompt a line (line N's image is OUTDIR/N.png, N zero-padded to five
digits: 00001.png), or a .jsonl file, one `{"id": ..., "prompt": "..."}` a line with optionally its
own `seed` and `negative` (the image is OUTDIR/ID.png; blank lines are skipped). An item without a
seed gets --seed (default 0) plus its line number less one, so a re-run, or a run resumed after a
stop, draws the same images.

Each image is written the moment it is drawn, atomically (a temporary file renamed into place:
Ctrl-C or a killed process leaves only whole PNGs), with its settings as PNG metadata. A re-run
skips the items whose PNG is there (--force draws them again) and removes the hidden temporary
files a killed run may have left. A bad item (an empty prompt, a line
that is not JSON, a bad seed, an id that is not a plain file name, an id used twice) is named by
its line and left out, and the rest run; the exit status is then 1. A prompt longer than a text
encoder reads is drawn from the part it reads, as diffusers does, with a warning naming the item.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from genfast.diffusion.generator import MAX_SEED, check_prompt, check_seed
from genfast.errors import UserError
from genfast.interface.batch import Summary

FIELDS = ("id", "prompt", "seed", "negative")
SAFE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")  # a file name on every system, never hidden


@dataclass(frozen=True)
class PromptItem:
    """One prompt of the file: where it is, its id (the PNG's name), seed and negative prompt."""

    line: int
    id: str
    prompt: str
    seed: int
    negative: str | None = None

    @property
    def file_name(self) -> str:
        return f"{self.id}.png"

    def row(self) -> dict[str, Any]:
        """The item as a row for `ImageGenerator.__call__` (Ray Data)."""
        return {"line": self.line, "id": self.id, "prompt": self.prompt, "seed": self.seed, "negative": self.negative}


def read_prompts(path: Path, base_seed: int, summary: Summary, stream: TextIO | None = None) -> list[PromptItem]:
    """The items of a prompts file (.jsonl: JSON lines, anything else: a prompt a line); each bad
    one is reported (`summary.fail`) and left out."""
    if not path.is_file():
        raise UserError(f"prompts file not found: {path}")
    if path.suffix.lower() == ".json":  # read as text, each line would be drawn as a prompt
        raise UserError(f"{path}: a prompts file is text (a prompt a line) or .jsonl (an object a line): rename it")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"prompts file {path} is not UTF-8 text") from e
    jsonl = path.suffix.lower() == ".jsonl"
    items: list[PromptItem] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(lines, 1):
        if jsonl and not text.strip():
            continue
        try:
            if jsonl:
                item = _item_of_line(number, text, base_seed)
            else:  # the line number names the PNG, zero-padded so that names sort as lines do
                item = _item(number, f"{number:05d}", text, None, None, base_seed)
            key = item.id.casefold()  # Cat.png and cat.png are one file on macOS and Windows
            if key in seen:
                raise ValueError(f"id {item.id!r} repeats line {seen[key]}'s (ids name the PNGs: make them unique)")
        except ValueError as e:
            summary.fail(f"line {number}: {e}", stream)
            continue
        seen[key] = number
        items.append(item)
    return items


def _item_of_line(number: int, text: str, base_seed: int) -> PromptItem:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError('not a JSON object: give {"id": ..., "prompt": "..."}')
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown fields {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    if "id" not in record:
        raise ValueError('no "id" (a string or an integer: it names the PNG)')
    identifier = record["id"]
    if isinstance(identifier, bool) or not isinstance(identifier, (str, int)):
        raise ValueError(f'"id" must be a string or an integer, not {json.dumps(identifier)}')
    return _item(number, str(identifier), record.get("prompt"), record.get("seed"), record.get("negative"), base_seed)


def _item(number: int, identifier: str, prompt: Any, seed: Any, negative: Any, base_seed: int) -> PromptItem:
    name = f"id {identifier!r}"
    if not SAFE_ID.fullmatch(identifier) or identifier.endswith("."):
        raise ValueError(
            f"{name} cannot name a file: use letters, digits, '_', '-' and '.' (not first), up to 100 characters"
        )
    try:
        check_prompt(prompt)
        if seed is None:
            seed = base_seed + number - 1
            if seed > MAX_SEED:
                raise ValueError(f"--seed {base_seed} plus the line number is past the largest seed, {MAX_SEED}")
        seed = check_seed(seed)
        if negative is not None and not isinstance(negative, str):
            raise ValueError('"negative" must be text')
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return PromptItem(number, identifier, prompt, seed, negative)


def check_file_flags(args: argparse.Namespace) -> tuple[Path, Path]:
    """--prompts' flags, checked before the slow load: the prompts file and the output folder."""
    if args.prompt is not None:
        raise UserError("--prompts takes its prompts from the file: drop the prompt argument")
    if args.output is None:
        raise UserError("--prompts needs -o OUTDIR: the folder for the images")
    source, outdir = Path(args.prompts).expanduser(), Path(args.output).expanduser()
    if not source.is_file():
        raise UserError(f"prompts file not found: {source}")
    if outdir.exists() and not outdir.is_dir():
        raise UserError(f"-o {outdir} exists and is not a folder: with --prompts it names a folder for the images")
    return source, outdir


def items_to_draw(
    source: Path, outdir: Path, base_seed: int, force: bool, summary: Summary, stream: TextIO | None = None
) -> list[PromptItem]:
    """The file's good items whose PNG is not in `outdir` yet (all of them with `force`)."""
    items = read_prompts(source, base_seed, summary, stream)
    from genfast.interface import images

    todo = [item for item in items if force or not (outdir / item.file_name).exists()]
    summary.skipped = len(items) - len(todo)
    images.remove_stale_staging(outdir / item.file_name for item in todo)
    return todo


def write_image(outdir: Path, item: PromptItem, image: Any, text: dict[str, str]) -> None:
    """The item's PNG, atomically, with its settings (`ImageGenerator.png_text`) as metadata."""
    from genfast.interface import images

    images.write_files({outdir / item.file_name: images.png_bytes(image, text)}, force=True)


def imagine_file_command(args: argparse.Namespace, stream: TextIO | None = None) -> int:
    """Every item of --prompts not yet in OUTDIR, `--batch-size` at a time. Exit status 1 when an
    item was left out."""
    from genfast.diffusion.commands import describe, load_announced
    from genfast.interface.progress import Progress

    stream = stream if stream is not None else sys.stderr
    source, outdir = check_file_flags(args)
    summary = Summary()
    todo = items_to_draw(source, outdir, args.seed or 0, args.force, summary, stream)
    if todo:
        generator = load_announced(args)
        runnable = []
        for item in todo:
            try:
                generator.check(item.prompt, item.seed, item.negative)
            except ValueError as e:
                summary.fail(f"line {item.line}: id {item.id!r}: {e}", stream)
                continue
            if (cut := generator.truncation(item.prompt)) is not None:
                print(f"genfast: warning: line {item.line}: id {item.id!r}: the prompt is {cut}", file=stream)
            runnable.append(item)
        print(describe(generator, args, f"seeds from {args.seed or 0} + line - 1"), file=stream, flush=True)
        outdir.mkdir(parents=True, exist_ok=True)
        progress = Progress(len(runnable), "images", stream)
        try:
            for start in range(0, len(runnable), args.batch_size):
                batch = runnable[start : start + args.batch_size]
                drawn = generator.draw([i.prompt for i in batch], [i.seed for i in batch], [i.negative for i in batch])
                for item, image in zip(batch, drawn, strict=True):
                    write_image(outdir, item, image, generator.png_text(item.prompt, item.seed, item.negative))
                    summary.done += 1
                    progress.advance()
        finally:
            progress.finish()
    print(f"genfast: {summary.line()}; images in {outdir}", file=stream, flush=True)
    return 1 if summary.failed else 0
