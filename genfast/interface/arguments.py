"""Command-line pieces several commands share: value types and the flags that mean one thing
everywhere (--device, --dtype, --threads, --recipe). Torch-free: the parser is built without it."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from genfast.recipe import Recipe

Handler = Callable[[argparse.Namespace], int]


def lazy(module: str, function: str) -> Handler:
    """A command handler imported when it runs (the parser stays fast and torch-free)."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)

    return run


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None


def _whole_number_up_to(limit: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = non_negative_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{what} is 0 to {limit}, got {value}")
        return value

    return parse


port_number = _whole_number_up_to(65535, "a TCP port")  # 0: any free one
seed = _whole_number_up_to(2**63 - 1, "a seed")  # torch's generators take a signed 64-bit seed


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def non_negative_float(text: str) -> float:
    value = _number(text)
    if not value >= 0.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def unit_float(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in 0..1, got {value}")
    return value


def add_device(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")


def add_threads(p: argparse.ArgumentParser | argparse._ArgumentGroup, beside_other_work: bool = False) -> None:
    """`beside_other_work`: the command leaves cores that other processes keep busy to them
    (genfast/platform/threads.py)."""
    default = (
        "one per physical core, less the CPUs that other processes kept busy while the model loaded"
        if beside_other_work
        else "torch's choice: one per physical core"
    )
    p.add_argument("--threads", type=positive_int, default=None, help=f"CPU threads (default: {default})")


DTYPE_HELP = (
    "the dtype of the recipe's bf16 step and every later one: auto (bfloat16 where the CPU or GPU "
    "computes in it natively; elsewhere the step is left out, except for LLMs, which keep bf16 weights "
    "and compute in float32: `genfast info` says which), bfloat16, float32 (no bf16 step) or float16 "
    "(CUDA only)"
)


def add_low_precision_dtype(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)  # checked by genfast.platform.hardware.dtype_name


def add_recipe(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    recipe: Recipe,
    default: str,
    dtype_default: str = "auto",
    dtype_help: str = DTYPE_HELP,
) -> None:
    """--recipe STEP (every step of the workload's recipe up to STEP, genfast/recipe.py) and
    --dtype, which says what its bf16 step computes in."""
    p.add_argument(
        "--recipe",
        default=default,
        choices=recipe.names,
        metavar="STEP",
        help=f"the last recipe step to apply, all earlier ones included: {', '.join(recipe.names)} "
        f"(default: {default}; `genfast bench {recipe.workload} --list-steps` shows what each does)",
    )
    p.add_argument("--dtype", default=dtype_default, help=dtype_help)  # checked by genfast.platform.hardware.dtype_name


def add_bench_args(p: argparse.ArgumentParser, workload: str, repeats: int) -> None:
    """The flags every `genfast bench WORKLOAD` takes (genfast/bench/ladder.py)."""
    g = p.add_argument_group("ladder")
    g.add_argument(
        "--steps",
        default=None,
        metavar="STEP,STEP",
        help=f"comma-separated rows to measure, in ladder order (default: the whole {workload} ladder; "
        "--list-steps shows the steps)",
    )
    g.add_argument(
        "--without",
        default=None,
        metavar="STEP,STEP",
        help="comma-separated steps left out of every row (e.g. a step that does not pay on this machine); "
        "their own rows are not measured",
    )
    g.add_argument("--list-steps", action="store_true", help="print the recipe's steps with their contracts and exit")
    g.add_argument("--repeats", type=positive_int, default=repeats, help=f"timed calls per row (default {repeats})")
    add_device(g)
    add_low_precision_dtype(g)
    add_threads(g)
    g.add_argument("--json", dest="json_path", default=None, help="also write the rows as JSON to this file")
    g.add_argument(
        "--plot",
        dest="plot_path",
        default=None,
        metavar="FILE.png",
        help="also draw the ladder as a bar chart (speed-ups, accuracy, the machine) into this PNG "
        "(needs matplotlib: pip install genfast[plot])",
    )
    g.add_argument("--force", action="store_true", help="overwrite an existing --json or --plot file")


def add_ray(p: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    """--ray [ADDRESS], --actors and --cpus-per-actor of a batch command (genfast/ray/); `what`
    says what --ray does to the command's outputs."""
    p.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        metavar="ADDRESS",
        help=f"run on a Ray cluster (this machine's with no ADDRESS); {what} (pip install 'genfast[ray]')",
    )
    p.add_argument(
        "--actors", type=positive_int, default=1, help="with --ray: model copies working at once (default 1)"
    )
    p.add_argument(
        "--cpus-per-actor", type=positive_int, default=1, help="with --ray: CPUs each copy reserves (default 1)"
    )
