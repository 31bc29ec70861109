"""`genfast bench <workload>`: a recipe's ladder measured row by row, one fresh process per row.

The parent checks the rows, prints a header, runs every row in a fresh interpreter (honest peak
memory, no compiled code or caches shared between rows), computes the speed-ups against the
reference row of each group and prints the table (genfast.bench.table.report). The child
(`python -m genfast.bench ROW.json`) builds the row, times a first call (warm-up
and any compilation), then `repeats` calls, and writes the row: the median seconds, the first
call's, the seconds from the process's launch to the end of that first call (a user's wait for a
first result), compile time (first call minus the median, for compiled rows), peak memory, the
workload's own figures and its agreement with the reference outputs, which the reference rows
leave in a directory all rows of one run share.

A workload supplies only what differs: a `Ladder` (which rows, how to build and time one, how its
outputs compare). A row that cannot run here is measured as "skipped: <reason>" (the recipe's rule,
genfast/recipe.py); a step that runs in a lesser form says so in the row's note.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from genfast.bench.plot import ACCURACY_LABELS
from genfast.bench.table import median, report
from genfast.errors import UserError
from genfast.interface.startup import since_launch
from genfast.recipe import Plan, Recipe, Target
from genfast.storage.files import check_outputs, write_json_atomic

Column = tuple[str, str, str]  # (row key, header, format spec)
# The columns every ladder shows (a workload adds its own between them).
STEP: Column = ("step", "step", "")
SPEEDUP: Column = ("speedup", "vs baseline", ".2f")
PEAK_MEMORY: Column = ("peak_mem_gb", "peak mem GB", ".2f")
COMPILE_TIME: Column = ("compile_s", "compile s", ".0f")
NOTE: Column = ("note", "note", "")
Options = dict[str, Any]  # a ladder's settings for one run, JSON-able (they travel to the child)
# The Options key of {settings field: value} for the recipe steps' parameters a bench flag sets
# (Step.tunes, e.g. the feature cache's threshold): every row's plan is made with them (Ladder.plan).
TUNED = "tuned"
WITHOUT = "without"  # the Options key of the steps --without leaves out of every row's plan


@dataclass(frozen=True)
class Row:
    """One row to measure: a recipe step (or a workload's extra row, e.g. the original package) and
    what else varies between rows (e.g. {"batch_size": 8}); rows compare within their group."""

    step: str
    group: dict[str, Any] = field(default_factory=dict)


@dataclass
class Case:
    """One built row, in the child: `run` is the timed call; `measure(outputs, seconds)` turns the
    timed calls' outputs into the row's own figures."""

    run: Callable[[], Any]
    measure: Callable[[list[Any], list[float]], dict[str, Any]] = lambda outputs, seconds: {}
    compiled: bool = False  # report compile time (first call minus the median)
    # Figures of the first call's output, given the seconds since launch when it started (e.g.
    # the first token's time after launch).
    first: Callable[[Any, float], dict[str, Any]] = lambda output, started: {}
    # More for the row's note, read after the timed calls (e.g. whether compiled code was loaded).
    notes: Callable[[], list[str]] = lambda: []


class Ladder(ABC):
    """What one workload's benchmark supplies."""

    workload: str
    recipe: Recipe
    columns: tuple[Column, ...]
    speed_key: str  # the row figure speed-ups are computed from
    higher_is_faster: bool = True
    reference_steps: tuple[str, ...] = ("baseline",)  # speed-ups are against the first of these in a group

    # ---- in the parent ----
    def options(self, args: argparse.Namespace) -> Options:
        """The run's options from the command line, validated (before any slow work)."""
        options = {"device": args.device, "dtype": args.dtype, "repeats": args.repeats, "threads": args.threads}
        without = getattr(args, "without", None)
        return {**options, WITHOUT: self.recipe.ordered(without.split(","))} if without else options

    def steps(self, text: str | None) -> list[str]:
        """The --steps value as row steps in ladder order (default: the whole recipe)."""
        return self.recipe.ordered(text.split(",")) if text else list(self.recipe.names)

    def kept(self, steps: list[str], options: Options) -> list[str]:
        """The row steps without those --without leaves out (and an error when none is left)."""
        kept = [step for step in steps if step not in options.get(WITHOUT, ())]
        if not kept:
            raise UserError("--without leaves out every row of --steps")
        return kept

    def rows(self, steps: list[str], options: Options) -> list[Row]:
        return [Row(step) for step in steps]

    @abstractmethod
    def header(self, options: Options, machine: str) -> str:
        """The line printed before the rows run (what is measured, on what)."""

    @abstractmethod
    def footnote(self, options: Options, rows: list[dict[str, Any]]) -> str:
        """The note printed under the table (how to read it)."""

    def model(self, options: Options) -> str:
        """What the rows are tagged with as their model."""
        return self.workload

    @property
    def accuracy_key(self) -> str | None:
        """The row figure that says how close a row stays to the reference, written on its bar in
        a --plot chart: by default the first of the ladder's columns that charts know as one."""
        return next((key for key, _, _ in self.columns if key in ACCURACY_LABELS), None)

    def tags(self) -> dict[str, Any]:
        """What every row of this ladder carries, so that its JSON alone can be tabled and plotted."""
        return {
            "workload": self.workload,
            "speed_key": self.speed_key,
            "higher_is_faster": self.higher_is_faster,
            "accuracy_key": self.accuracy_key,
        }

    def finish(self, rows: list[dict[str, Any]]) -> None:
        """Add columns that compare rows (after the speed-ups), in place."""

    def launch(self, spec: Path, options: Options) -> int | None:
        """In a row's process, before measuring: start other processes that measure the row
        together (e.g. tensor-parallel ranks) and return their exit code; None measures here."""
        return None

    # ---- in the child ----
    def plan(self, row: Row, options: Options, target: Target) -> Plan | None:
        """The recipe up to the row's step on `target`, with the steps' parameters the run's options
        tune (options[TUNED]) and without the steps they leave out (options[WITHOUT]); None for a
        workload's extra row."""
        if row.step not in self.recipe.names:
            return None
        return self.recipe.plan(row.step, target, options.get(TUNED), options.get(WITHOUT, ()))

    def skip_reason(self, row: Row, options: Options, target: Target) -> str | None:
        """Why `row` cannot run here: by default the recipe step's requirement."""
        return self.recipe.unavailable(row.step, target) if row.step in self.recipe.names else None

    @abstractmethod
    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        """Build the row (`plan`: the recipe up to its step; None for a workload's extra row)."""

    def compare(self, row: Row, output: Any, workdir: Path) -> dict[str, Any]:
        """Agreement of the row's last output with the reference rows' (which save theirs here)."""
        return {}


def run(ladder: Ladder, args: argparse.Namespace) -> int:
    """The parent: every row in its own process, then the table."""
    import torch

    from genfast.bench.machine import describe_machine, machine_info
    from genfast.platform.hardware import resolve_device

    device = resolve_device(args.device)
    if args.list_steps:
        from genfast.platform.hardware import dtype_name

        print(ladder.recipe.describe(Target(device, dtype_name(args.dtype))))
        return 0
    plot_path = getattr(args, "plot_path", None)
    if plot_path:
        from genfast.bench.plot import require_matplotlib

        require_matplotlib()  # before the rows run, which may take many minutes
    outputs = [Path(p) for p in (args.json_path, plot_path) if p]
    if outputs:
        check_outputs(outputs, args.force, inputs=[getattr(args, "model", None)])
    steps = ladder.steps(args.steps)
    if args.threads:
        torch.set_num_threads(args.threads)  # so the machine line matches the rows
    options = ladder.options(args)
    rows = ladder.rows(ladder.kept(steps, options), options)
    info = machine_info(device)
    header = ladder.header(options, describe_machine(info))
    if options.get(WITHOUT):
        header += f"; every row without {', '.join(options[WITHOUT])}"
    print(header, file=sys.stderr, flush=True)
    results = []
    failed = []
    with tempfile.TemporaryDirectory(prefix=f"genfast-bench-{ladder.workload}-") as workdir:
        for row in rows:
            group = "".join(f", {k.replace('_', ' ')} {v}" for k, v in row.group.items())
            print(f"  {row.step}{group} ...", file=sys.stderr, flush=True)
            # A row that fails is reported as such and the ladder goes on: the other rows' numbers
            # stay (a long GPU run is not lost to one step); the command still exits non-zero.
            result = _run_isolated(ladder, row, options, Path(workdir))
            if result is None:
                failed.append(row.step)
                result = {"step": row.step, **row.group, "group": list(row.group), "note": "failed (see the error)"}
            elif result.get(ladder.speed_key) is not None:
                print(f"    {ladder.speed_key} {result[ladder.speed_key]:.4g}", file=sys.stderr, flush=True)
            if result is not None:  # the whole row as it comes: a run stopped early keeps it
                print(f"    {json.dumps(result, default=str)}", file=sys.stderr, flush=True)
            results.append(result)
    speedups(ladder, results)
    ladder.finish(results)
    for result in results:
        result.update(ladder.tags())
    report(results, ladder.columns, info, ladder.model(options), ladder.footnote(options, results), args.json_path)
    if plot_path:
        from genfast.bench.plot import plot_rows

        plot_rows(results, plot_path)
    if failed:
        names = list(dict.fromkeys(failed))  # a step fails in each group alike
        raise UserError(f"benchmark rows of {', '.join(names)} failed; see the errors above")
    return 0


def speedups(ladder: Ladder, rows: list[dict[str, Any]]) -> None:
    """`speedup` of every measured row against its group's reference row: the first of
    `ladder.reference_steps` measured in the group (none without one)."""
    key = ladder.speed_key
    measured = [r for r in rows if r.get(key)]
    for row in measured:
        same_group = [r for r in measured if all(r.get(k) == row.get(k) for k in row.get("group", ()))]
        reference = next((r for step in ladder.reference_steps for r in same_group if r["step"] == step), None)
        if reference is not None:
            ratio = row[key] / reference[key]
            row["speedup"] = ratio if ladder.higher_is_faster else 1 / ratio


def _run_isolated(ladder: Ladder, row: Row, options: Options, workdir: Path) -> dict[str, Any] | None:
    """The row measured in a fresh process; None if that process failed (it printed why)."""
    with tempfile.TemporaryDirectory(prefix="genfast-bench-row-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "row.json"
        ladder_path = f"{type(ladder).__module__}:{type(ladder).__name__}"
        spec.write_text(
            json.dumps(
                {
                    "ladder": ladder_path,
                    "row": asdict(row),
                    "options": options,
                    "workdir": str(workdir),
                    "out": str(out),
                }
            )
        )
        done = subprocess.run([sys.executable, "-m", "genfast.bench", str(spec)], stdout=subprocess.DEVNULL)
        if done.returncode != 0 or not out.exists():
            print(f"genfast: benchmark row {row.step} failed (exit code {done.returncode})", file=sys.stderr)
            return None
        return json.loads(out.read_text())


def _ladder(spec: dict[str, Any]) -> Ladder:
    module, _, name = spec["ladder"].partition(":")
    return getattr(importlib.import_module(module), name)()


def measure_row(spec: dict[str, Any]) -> dict[str, Any]:
    """The child: build, warm up and time one row."""
    import torch

    from genfast.platform.hardware import peak_memory_bytes, resolve_device
    from genfast.platform.threads import BUSY_CPUS_THAT_COUNT, OtherWork

    ladder = _ladder(spec)
    row, options, workdir = Row(**spec["row"]), spec["options"], Path(spec["workdir"])
    if options.get("threads"):
        torch.set_num_threads(options["threads"])
    target = Target(resolve_device(options["device"]), options["dtype"])
    result: dict[str, Any] = {"step": row.step, **row.group, "group": list(row.group)}
    if options.get(WITHOUT):
        result[WITHOUT] = options[WITHOUT]
    reason = ladder.skip_reason(row, options, target)
    if reason:
        result["note"] = f"skipped: {reason}"
        return result
    plan = ladder.plan(row, options, target)
    case = ladder.build(row, plan, options, target, workdir)
    started = since_launch()
    start = time.perf_counter()
    output = case.run()  # warm-up (and compilation)
    first_s = time.perf_counter() - start
    result.update(case.first(output, started))
    outputs, seconds = [], []
    other_work = OtherWork()  # honest numbers: say when other processes competed for the CPU
    for _ in range(options["repeats"]):
        start = time.perf_counter()
        outputs.append(case.run())
        seconds.append(time.perf_counter() - start)
    # Tensor-parallel ranks (a launcher's processes) run side by side: the others are not other work.
    alone = target.device.type == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) == 1
    busy = other_work.busy_cores() if alone else None
    result.update(
        {
            "seconds": median(seconds),
            "first_call_s": first_s,
            "compile_s": max(first_s - median(seconds), 0.0) if case.compiled else None,
            "peak_mem_gb": peak_memory_bytes(target.device) / 1e9,
        }
    )
    result.update(case.measure(outputs, seconds))
    result.update(ladder.compare(row, outputs[-1] if outputs else output, workdir))
    notes = [f"{step}: {note}" for step, note in plan.notes] if plan else []
    notes += [f"{step} left out: {why}" for step, why in plan.skipped] if plan else []
    notes += case.notes()
    notes += _cuda_graph_notes()
    if busy is not None and busy >= BUSY_CPUS_THAT_COUNT:
        notes.append(f"other processes kept {busy:.1f} CPUs busy while it was timed: slower than this machine runs it")
    result["note"] = "; ".join(notes) or result.get("note")
    return result


def _cuda_graph_notes() -> list[str]:
    """A row whose compiled code was meant to replay CUDA graphs and did not says so: launch
    overhead then counts in its time (inductor logs why only under TORCH_LOGS=cudagraphs)."""
    from torch._dynamo.utils import counters

    skipped = counters["inductor"]["cudagraph_skips"]
    return [f"CUDA graphs skipped in {skipped} compiled graph(s) (TORCH_LOGS=cudagraphs says why)"] if skipped else []


def main(argv: list[str]) -> int:
    """`python -m genfast.bench ROW.json`: measure one row and write it where the spec says, in a
    process set up as the CLI's (genfast/interface/process.py)."""
    from genfast.interface.process import prepare_process

    prepare_process()
    spec = json.loads(Path(argv[0]).read_text())
    try:
        code = _ladder(spec).launch(Path(argv[0]), spec["options"])
        if code is not None:
            return code
        result = measure_row(spec)
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":  # tensor-parallel ranks fail alike: rank 0 reports
            print(f"genfast: error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # tensor-parallel ranks measure alike: rank 0 reports
        write_json_atomic(spec["out"], result)
    return 0
