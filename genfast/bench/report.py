"""The performance page's tables and charts, generated from bench rows kept as JSON.

`python -m genfast.bench.report [docs/performance.md]` rewrites every block of the page that sits
between `<!-- results: FILE -->` and `<!-- end results -->` (FILE relative to the page, a list of
rows as `genfast bench ... --json` writes them) with a chart link, a table and the rows' provenance,
and draws each chart into images/ beside the page (genfast/bench/plot.py; needs matplotlib).
`--check` only compares: it exits 1 where a block differs from what its JSON gives, so a test can
hold the page to its files without matplotlib.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from genfast.bench.plot import replace_atomically, speedups
from genfast.bench.table import markdown_table
from genfast.errors import UserError

Column = tuple[str, str, str]  # (row key, header, format spec), as genfast/bench/ladder.py's
BLOCK = re.compile(r"(<!-- results: (?P<file>[^>]+?) -->\n)(?P<body>.*?)(<!-- end results -->)", re.DOTALL)
SPEEDUP = "__speedup"  # the speed-up column, computed as the chart computes it; its header names the reference

# The columns a user reads on the page, per workload (the bench prints more); a column no row has a
# value for is left out of its table.
# fmt: off
PAGE_COLUMNS: dict[str, tuple[Column, ...]] = {
    "llm": (
        ("dtype", "dtype", ""), ("decode_tok_s", "decode tok/s", ".1f"), (SPEEDUP, "", ".2f"),
        ("vs_compile", "vs compile", ".2f"),
        ("prefill_tok_s", "prefill tok/s", ".0f"), ("serving_tok_s", "serving tok/s", ".1f"),
        ("ttft_ms", "TTFT ms", ".1f"), ("mbu", "MBU", ".0%"),
        ("peak_mem_gb", "peak mem GB", ".2f"), ("compile_s", "compile s", ".0f"),
        ("greedy_match", "same greedy tokens", ".0%"), ("llama_cpp_format", "llama.cpp weights", ""),
        ("llama_cpp_decode_tok_s", "llama.cpp decode tok/s", ".1f"),
        ("llama_cpp_prefill_tok_s", "llama.cpp prefill tok/s", ".0f"), ("vs_llama_cpp", "vs llama.cpp", ""),
    ),
    "sam": (
        ("img_s", "img/s", ".3f"), ("frames_s", "frames/s", ".3f"), (SPEEDUP, "", ".2f"),
        ("peak_mem_gb", "peak mem GB", ".2f"), ("mem_growth_mb_per_frame", "MB/frame", ".1f"),
        ("masks_found", "masks found", ".0%"), ("masks", "masks kept", ".0f"), ("mask_iou", "mask IoU", ".4f"),
        ("logit_rel_err", "logit rel err", ".1e"), ("compile_s", "compile s", ".0f"),
    ),
    "diffusion": (
        ("s_per_image", "s/image", ".2f"), (SPEEDUP, "", ".2f"), ("s_per_denoiser_step", "s/denoiser step", ".3f"),
        ("compile_s", "compile s", ".0f"), ("peak_mem_gb", "peak mem GB", ".2f"),
        ("psnr_db", "PSNR vs baseline dB", ".1f"), ("psnr_vs_sdpa_db", "PSNR vs fp32 SDPA dB", ".1f"),
    ),
}
# fmt: on
GENERIC: tuple[Column, ...] = ((SPEEDUP, "", ".2f"),)


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of one JSON file, checked to be bench rows."""
    try:
        rows = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; the page names it in a results block") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "step" in r for r in rows):
        raise UserError(f"{path} is not a list of benchmark rows (as `genfast bench --json` writes)")
    return rows


def image_name(json_file: str) -> str:
    """The chart's file name for a JSON file named relative to the page: results/a/b.json -> a-b.png."""
    parts = Path(json_file).with_suffix("").parts
    return "-".join(parts[1:] if parts[0] == "results" and len(parts) > 1 else parts) + ".png"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of `rows`: the step, what tells groups apart, the workload's page columns
    that have a value, the note."""
    values, against = speedups(rows)
    rows = [{**row, SPEEDUP: value} for row, value in zip(rows, values)]
    workload = next((r["workload"] for r in rows if r.get("workload")), None)
    groups = list(dict.fromkeys(k for r in rows for k in r.get("group", ())))
    columns = [("step", "step", "")] + [(k, k.replace("_", " "), "") for k in groups]
    for key, header, spec in PAGE_COLUMNS.get(workload, GENERIC):
        if any(r.get(key) is not None for r in rows):
            columns.append((key, header or f"speed-up {against}", spec))
    if any(r.get("note") for r in rows):
        columns.append(("note", "note", ""))
    cells = [{key: _text(row.get(key), spec) for key, _, spec in columns} for row in rows]
    return markdown_table(cells, [(key, header, "") for key, header, _ in columns])


def _text(value: Any, spec: str) -> str | None:
    """A cell: a number in its column's format, several recorded runs one after the other, text
    (a recorded range) as it is."""
    if value is None:
        return None
    if isinstance(value, list):
        return ", ".join(_text(v, spec) or "-" for v in value)
    if isinstance(value, int | float) and not isinstance(value, bool) and spec:
        return format(value, spec)
    return str(value)


def provenance(rows: list[dict[str, Any]]) -> str:
    """Where the rows come from: the machine, and the notes' section and command for a transcription."""
    from genfast.bench.plot import machine_line

    lines = [f"Machine: {machine_line(rows)}."]
    for key, label in (("model", "Model"), ("command", "Command"), ("source", "From"), ("conditions", "Conditions")):
        seen = list(dict.fromkeys(str(r[key]) for r in rows if r.get(key)))
        if seen:
            text = "; ".join(f"`{s}`" if key == "command" else s for s in seen)
            lines.append(f"{label}: {text}.")
    if not any(r.get("source") for r in rows):
        lines.append("From: direct `genfast bench --json` output.")
    return "\n".join(lines)


def block(json_file: str, page_dir: Path) -> str:
    """The generated body of one results block."""
    rows = load_rows(page_dir / json_file)
    alt = f"genfast bench {rows[0].get('workload', '')} ladder: {json_file}"
    return f"![{alt}](images/{image_name(json_file)})\n\n{table(rows)}\n\n{provenance(rows)}\n"


def render(text: str, page_dir: Path) -> str:
    """The page with every results block regenerated from its JSON file."""
    return BLOCK.sub(lambda m: m.group(1) + block(m.group("file"), page_dir) + m.group(4), text)


def result_files(text: str) -> list[str]:
    """The JSON files the page's results blocks name, in order."""
    return [m.group("file") for m in BLOCK.finditer(text)]


def draw_charts(text: str, page_dir: Path) -> list[Path]:
    """Draw the chart of every results block into images/ beside the page (needs matplotlib)."""
    from genfast.bench.plot import plot_rows, require_matplotlib

    require_matplotlib()
    images = page_dir / "images"
    images.mkdir(exist_ok=True)
    drawn = []
    for json_file in result_files(text):
        path = images / image_name(json_file)
        plot_rows(load_rows(page_dir / json_file), path)
        drawn.append(path)
    return drawn


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m genfast.bench.report", description=__doc__.split("\n")[0])
    parser.add_argument("page", nargs="?", default="docs/performance.md", help="default: docs/performance.md")
    parser.add_argument("--check", action="store_true", help="only compare the page's tables with its JSON files")
    parser.add_argument("--no-charts", action="store_true", help="rewrite the tables, leave the charts as they are")
    args = parser.parse_args(argv)
    page = Path(args.page)
    try:
        text = page.read_text()
        new = render(text, page.parent)
        if args.check:
            if new != text:
                print(f"{page}: tables differ from their JSON files; run python -m genfast.bench.report {page}")
                return 1
            return 0
        if new != text:
            replace_atomically(page, lambda tmp: Path(tmp).write_text(new))
        charts = [] if args.no_charts else draw_charts(new, page.parent)
    except (UserError, OSError) as e:
        print(f"genfast: error: {e}", file=sys.stderr)
        return 2
    print(f"{page}: {len(result_files(new))} tables, {len(charts)} charts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
