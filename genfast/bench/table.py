"""Benchmark rows as a markdown table and as JSON (written atomically, never over a file unasked)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from genfast.bench.machine import describe_machine
from genfast.storage.files import write_json_atomic


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec); a missing value prints as '-'."""

    def cell(row: dict[str, Any], key: str, spec: str) -> str:
        value = row.get(key)
        if value is None:
            return "-"
        return format(value, spec) if spec else str(value)

    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r, k, s) for k, _, s in columns) + " |" for r in rows]
    return "\n".join(lines)


def report(
    rows: list[dict[str, Any]],
    columns: Sequence[tuple[str, str, str]],
    info: dict[str, Any],
    model: str,
    footnote: str,
    json_path: str | Path | None,
) -> None:
    """The end of every `genfast bench`: tag the rows with the machine and model, print the table
    and its footnote (followed by the machine), write the rows as JSON when asked."""
    for row in rows:
        row.update({"device": info["device"], "isa": info.get("isa"), "torch": info["torch"], "model": model})
    print(markdown_table(rows, columns))
    print(f"\n{footnote} Machine: {describe_machine(info)}.")
    if json_path:
        write_json_atomic(json_path, rows)
