"""The shared bench ladder (genfast/bench/ladder.py) on a toy workload: each row in its own
process, warm-up and repeats, speed-ups within groups, skipped rows, references across rows."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from genfast.bench.ladder import NOTE, SPEEDUP, STEP, Case, Ladder, Options, Row, run, speedups
from genfast.errors import UserError
from genfast.recipe import Plan, Recipe, Step, Target
from tests.busy import busy_loop


@dataclass(frozen=True)
class ToySettings:
    work: int = 1


def _no_gpu(target: Target) -> str | None:
    return "needs a GPU" if target.device.type != "cuda" else None


TOY = Recipe("toy", ToySettings, [
    Step("baseline", "all the work", "the reference"),
    Step("half", "half the work", "exact", {"work": 2}),
    Step("gpu", "on a GPU", "exact", {"work": 4}, needs=_no_gpu),
])  # fmt: skip


class ToyLadder(Ladder):
    workload = "toy"
    recipe = TOY
    speed_key = "seconds"
    higher_is_faster = False
    columns = (STEP, ("seconds", "s", ".4f"), SPEEDUP, ("pid", "pid", "d"), ("same", "same as baseline", ""), NOTE)

    def rows(self, steps: list[str], options: Options) -> list[Row]:
        return [Row(step, {"size": size}) for size in (1, 2) for step in steps]

    def header(self, options: Options, machine: str) -> str:
        return "toy"

    def footnote(self, options: Options, rows: list[dict[str, Any]]) -> str:
        return "toy rows"

    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        n = 200_000 * row.group["size"] // plan.settings.work

        def measure(outputs: list, seconds: list[float]) -> dict[str, Any]:
            return {"pid": os.getpid(), "calls": len(outputs)}

        def run() -> int:
            sum(range(n))  # the work
            return row.group["size"]  # what every step of the group must agree on

        return Case(run, measure)

    def compare(self, row: Row, output: Any, workdir: Path) -> dict[str, Any]:
        reference = workdir / f"baseline-{row.group['size']}.json"
        if row.step == "baseline":
            reference.write_text(json.dumps(output))
            return {}
        return {"same": json.loads(reference.read_text()) == output}


def test_speedups_are_within_groups_and_need_a_reference_row():
    rows = [{"step": "baseline", "seconds": 2.0, "size": 1, "group": ["size"]},
            {"step": "half", "seconds": 1.0, "size": 1, "group": ["size"]},
            {"step": "half", "seconds": 2.0, "size": 2, "group": ["size"]},
            {"step": "gpu", "note": "skipped: needs a GPU", "size": 1, "group": ["size"]}]  # fmt: skip
    speedups(ToyLadder(), rows)
    assert [r.get("speedup") for r in rows] == [1.0, 2.0, None, None]  # size 2 has no baseline row


def test_every_row_runs_in_its_own_process(tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = argparse.Namespace(list_steps=False, json_path=str(out), force=False, steps=None, device="cpu",
                              dtype="auto", repeats=2, threads=None)  # fmt: skip
    assert run(ToyLadder(), args) == 0
    rows = json.loads(out.read_text())
    assert [(r["step"], r["size"]) for r in rows] == [(s, n) for n in (1, 2) for s in ("baseline", "half", "gpu")]
    measured = [r for r in rows if r["step"] != "gpu"]
    assert len({r["pid"] for r in measured} | {os.getpid()}) == len(measured) + 1
    assert all(r["calls"] == 2 and r["seconds"] > 0 and r["first_call_s"] > 0 for r in measured)
    assert all(r["compile_s"] is None and r["peak_mem_gb"] > 0 for r in measured)
    assert [r["same"] for r in measured if r["step"] == "half"] == [True, True]
    assert all(r["note"] == "skipped: needs a GPU" and "seconds" not in r for r in rows if r["step"] == "gpu")
    assert "| gpu |" in capsys.readouterr().out


def test_without_leaves_a_step_out_of_every_row(tmp_path, capsys):
    """--without half: no `half` rows, the other rows' plans leave it out (the toy's gpu step is
    then planned from the baseline's settings) and every row and the header say so."""
    out = tmp_path / "rows.json"
    args = argparse.Namespace(list_steps=False, json_path=str(out), force=False, steps=None, device="cpu",
                              dtype="auto", repeats=1, threads=None, without="half")  # fmt: skip
    assert run(ToyLadder(), args) == 0
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == ["baseline", "gpu"] * 2
    assert all(r["without"] == ["half"] for r in rows)
    assert "every row without half" in capsys.readouterr().err
    plan = ToyLadder().plan(Row("gpu"), {"without": ["half"]}, Target(torch_cuda(), "float32"))
    assert plan.settings == ToySettings(work=4) and plan.declined == (("half", "left out as asked"),)
    args.without, args.force = "baseline,half,gpu", True
    with pytest.raises(UserError, match="leaves out every row"):
        run(ToyLadder(), args)


def torch_cuda():
    import torch

    return torch.device("cuda")  # planned only: the toy's gpu step needs one


class FailingHalfLadder(ToyLadder):
    """The toy ladder whose `half` step raises in its row's process."""

    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        if row.step == "half":
            raise RuntimeError("this step breaks")
        return super().build(row, plan, options, target, workdir)


def test_a_failing_row_is_reported_and_the_other_rows_still_run(tmp_path, capsys):
    import pytest

    from genfast.errors import UserError

    out = tmp_path / "rows.json"
    args = argparse.Namespace(list_steps=False, json_path=str(out), force=False, steps="baseline,half", device="cpu",
                              dtype="auto", repeats=1, threads=None)  # fmt: skip
    with pytest.raises(UserError, match="rows of half failed"):
        run(FailingHalfLadder(), args)
    rows = json.loads(out.read_text())
    assert [(r["step"], r.get("seconds") is not None) for r in rows] == [
        ("baseline", True), ("half", False), ("baseline", True), ("half", False)
    ]  # fmt: skip
    assert all(r["note"].startswith("failed") for r in rows if r["step"] == "half")
    assert "| half |" in capsys.readouterr().out


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="samples /proc (Linux)")
def test_a_row_timed_beside_other_work_says_so(tmp_path):
    out = tmp_path / "rows.json"
    args = argparse.Namespace(list_steps=False, json_path=str(out), force=False, steps="baseline", device="cpu",
                              dtype="auto", repeats=2, threads=None)  # fmt: skip
    with busy_loop(count=2):  # more than a CPU busy, however the rows compete with them
        assert run(ToyLadder(), args) == 0
    rows = json.loads(out.read_text())
    assert all("CPUs busy while it was timed: slower than this machine runs it" in r["note"] for r in rows)


class HeapLadder(ToyLadder):
    """Each row reports whether its process keeps freed memory in malloc's heap."""

    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        from genfast.platform import heap

        return Case(lambda: None, lambda outputs, seconds: {"heap_kept": heap._kept})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_rows_keep_freed_memory_where_the_environment_asks(tmp_path, monkeypatch):
    """GENFAST_KEEP_FREED_MEMORY=1 reaches every row's process, as it does the CLI's: the rows are
    timed with the malloc setting a user's `genfast` command would have (each its own process)."""
    monkeypatch.setenv("GENFAST_KEEP_FREED_MEMORY", "1")
    out = tmp_path / "rows.json"
    args = argparse.Namespace(list_steps=False, json_path=str(out), force=False, steps="baseline,half", device="cpu",
                              dtype="auto", repeats=1, threads=None)  # fmt: skip
    assert run(HeapLadder(), args) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 4 and all(r["heap_kept"] is True for r in rows), rows
