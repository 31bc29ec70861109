"""A ladder as a bar chart: one bar per row, its speed-up against the reference row, the row's
accuracy figure written above it, skipped and failed rows shown as such, the machine in the title.

`plot_rows` takes the rows `genfast bench ... --json` writes, so a chart can be drawn again from a
saved file (genfast/bench/report.py draws the performance page's charts so). matplotlib is an
optional dependency (`pip install genfast[plot]`): `require_matplotlib` says so in one line before
any slow work.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from genfast.errors import UserError
from genfast.storage.files import make_public

# How the bench's accuracy columns read on a chart, by row key. A row says which of its figures is
# its accuracy (`accuracy_key`, see genfast/bench/ladder.py); a key not listed here prints as itself.
ACCURACY_LABELS = {
    "greedy_match": "greedy {:.0%}",
    "same_as_target": "same {:.0%}",
    "mask_iou": "IoU {:.3f}",
    "psnr_db": "PSNR {:.1f} dB",
    "psnr_vs_sdpa_db": "PSNR {:.1f} dB",
}
# Keys the chart's machine line reads from a row, in order.
MACHINE_KEYS = ("device", "isa", "torch")


def require_matplotlib() -> None:
    """Fail in one line where matplotlib is missing (before a ladder runs for minutes)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install genfast[plot]") from None


def accuracy_text(row: dict[str, Any]) -> str | None:
    """The row's accuracy figure as the chart writes it, None where it has none."""
    key = row.get("accuracy_key")
    value = row.get(key) if key else None
    if value is None:
        return None
    if isinstance(value, int | float):
        return ACCURACY_LABELS.get(key, key + " {:.3g}").format(value)
    return f"{ACCURACY_LABELS.get(key, key).split(' ')[0]} {value}"  # recorded as text (a range)


def _group_key(row: dict[str, Any]) -> tuple:
    return tuple((k, row.get(k)) for k in row.get("group", ()))


def speedups(rows: Sequence[dict[str, Any]]) -> tuple[list[float | None], str]:
    """Each row's speed-up and what it is against.

    Rows that carry `speedup` (the bench computes it against a group's reference row) keep it; the
    reference is the row at 1.0. Where no row has one (a run without its baseline row, e.g.
    `--steps compile,int8,int4`), each row is compared with the first row of its group that has
    the speed figure, higher or lower being faster as the rows say.
    """
    if any(r.get("speedup") is not None for r in rows):
        reference = next((r["step"] for r in rows if r.get("speedup") == 1), "the reference row")
        return [r.get("speedup") for r in rows], f"vs {reference}"
    key = next((r["speed_key"] for r in rows if r.get("speed_key")), None)
    firsts: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        if key and isinstance(row.get(key), int | float):
            firsts.setdefault(_group_key(row), row)
    values: list[float | None] = []
    for row in rows:
        first = firsts.get(_group_key(row))
        if first is None or not isinstance(row.get(key), int | float):
            values.append(None)
            continue
        ratio = row[key] / first[key]
        values.append(ratio if row.get("higher_is_faster", True) else 1 / ratio)
    steps = list(dict.fromkeys(first["step"] for first in firsts.values()))
    return values, "vs " + (" / ".join(steps) or "the first row")


def machine_line(rows: Sequence[dict[str, Any]]) -> str:
    """'device, ISA isa, torch version' for each machine the rows were measured on."""
    lines = []
    for row in rows:
        isa = f", ISA {row['isa']}" if row.get("isa") else ""
        torch = f", torch {row['torch']}" if row.get("torch") else ""
        line = f"{row.get('device') or 'unknown machine'}{isa}{torch}"
        if line not in lines:
            lines.append(line)
    return "; ".join(lines)


def bar_labels(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Each row's step, with the values that tell its group apart (e.g. batch size 8), and its dtype
    where two rows would read alike otherwise (an LLM ladder's compile row in fp32 and in bf16)."""
    labels = []
    for row in rows:
        group = [f"{k.replace('_', ' ')} {row.get(k)}" for k in row.get("group", ())]
        labels.append("\n".join([str(row.get("step", "?")), *group]))
    return [
        f"{label}\n{row['dtype']}" if labels.count(label) > 1 and row.get("dtype") else label
        for label, row in zip(labels, rows)
    ]


def _absent_reason(row: dict[str, Any]) -> str:
    note = str(row.get("note") or "not measured")
    return note if len(note) <= 60 else note[:57] + "..."


def plot_rows(rows: Sequence[dict[str, Any]], path: str | Path, title: str | None = None) -> None:
    """Draw `rows` (as `genfast bench --json` writes them) into the PNG `path`, written whole or
    not at all. Rows without a speed-up (skipped, failed, not recorded) get an empty slot that
    says why."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display: the chart only goes to a file
    import matplotlib.pyplot as plt

    if not rows:
        raise UserError("no benchmark rows to plot")
    values, against = speedups(rows)
    drawn = [v for v in values if v is not None]
    top = max(drawn + [1.0]) * 1.3
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.8))
    positions = range(len(rows))
    colors = ["#4c72b0" if v is not None and v >= 1 else "#c44e52" for v in values]
    ax.bar(positions, [v or 0 for v in values], color=colors)
    for x, (row, value) in enumerate(zip(rows, values)):
        if value is None:
            ax.text(x, top * 0.02, _absent_reason(row), rotation=90, ha="center", va="bottom", fontsize=7,
                    color="#555555")  # fmt: skip
            continue
        text = f"{value:.2f}x"
        accuracy = accuracy_text(row)
        if accuracy:
            text += f"\n{accuracy}"
        ax.text(x, value + top * 0.01, text, ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="#888888", linewidth=0.8, linestyle="--")
    ax.set_xticks(list(positions), bar_labels(rows), rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, top)
    ax.set_ylabel(f"speed-up {against}")
    workload = next((r["workload"] for r in rows if r.get("workload")), None)
    model = next((r["model"] for r in rows if r.get("model")), None)
    heading = title or " ".join(x for x in (f"genfast bench {workload}" if workload else "genfast bench", model) if x)
    ax.set_title(f"{heading}\n{machine_line(rows)}", fontsize=9)
    fig.tight_layout()
    # No metadata that changes from one matplotlib to the next: the same rows give the same bytes.
    replace_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None}))
    plt.close(fig)


def replace_atomically(path: str | Path, write: Callable[[str], None]) -> None:
    """Call `write(tmp)` on a temporary file beside `path`, then rename it over `path`: a reader
    never sees a half-written file, and a failed write leaves the old one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        make_public(tmp)
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
