"""`genfast serve` on the command line (the LLM's model and sampling flags, plus the server's).
Torch-free: the handler is imported to run."""

from __future__ import annotations

import argparse

from genfast.interface.arguments import lazy, non_negative_int, port_number, positive_int
from genfast.llm.cli import add_model_args, add_tp_arg

SERVE_DESCRIPTION = """Serve the OpenAI API (GET /v1/models, POST /v1/completions and /v1/chat/completions, streamed
or not; GET /health). Concurrent requests share decode steps in --max-batch KV-cache slots; with --tp N, rank 0 serves
and the other ranks mirror its model calls. Needs FastAPI and uvicorn: pip install 'genfast[serve]'."""


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with continuous batching", description=SERVE_DESCRIPTION
    )
    add_model_args(p)
    add_tp_arg(p)
    g = p.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; use 0.0.0.0 with --api-key)",
    )
    g.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    g.add_argument(
        "--max-batch",
        type=positive_int,
        default=8,
        help="KV-cache slots: requests decoded together in each step (default 8)",
    )
    g.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=64,
        help="requests that may wait for a slot; more are refused with 429 (default 64)",
    )
    g.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=256,
        help="prompt tokens prefilled between two decode steps: a long prompt is prefilled in "
        "chunks while the other requests keep decoding (default 256)",
    )
    g.add_argument(
        "--prefix-cache-mib",
        type=non_negative_int,
        default=1024,
        metavar="MIB",
        help="memory for the prefix cache: keys and values of earlier prompts, reused by any request "
        "that starts the same way (default 1024; 0: only each slot's own last request is reused)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $GENFAST_API_KEY, else none)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the --model file or directory name)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on Ctrl-C/SIGTERM, let in-flight requests finish this long, then cancel them (default 30)",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default info)",
    )
    p.set_defaults(run=lazy("genfast.serve.commands", "serve_command"))


def register_bench(bench: argparse._SubParsersAction) -> None:
    """No ladder of its own: serving is measured by benchmarks/serve_load.py."""
