"""Aggregate decode throughput of the continuous-batching engine: N concurrent clients, with
--max-batch 1 (one request at a time) against --max-batch N (all share each decode step).

    python benchmarks/serve_load.py [--model PATH] [--dtype bfloat16] [--clients 8] [--tokens 64]
                                    [--batches 1,8] [--repeats 3] [--no-compile]

Each client sends a different prompt and asks for exactly --tokens greedy tokens (EOS ignored).
Tokens/s is all clients' tokens over the wall time from the first submit to the last token: what
a server delivers in aggregate. Also printed: the median time to first token and the tokens/s a
single client sees. In-process (no HTTP), so it measures the engine. Compile time is excluded
(warm-up) and reported apart; each row is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from genfast.bench.machine import machine_info
from genfast.llm.session import load
from genfast.serve.engine import Engine, GenerationRequest

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time",
    "The three primary colors are",
    "import numpy as np\n",
    "In 1969, the first",
    "My favourite food is",
    "Water boils at",
]


def run_clients(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, list[float], list[float]]:
    """All clients at once; returns (wall seconds, per-client time to first text, per-client tok/s)."""
    ttft = [0.0] * len(prompts)
    rates = [0.0] * len(prompts)
    start = time.perf_counter()

    def client(i: int) -> None:
        first: list[float] = []
        result = engine.generate(
            GenerationRequest(tuple(prompts[i]), tokens), on_text=lambda _: first or first.append(time.perf_counter())
        )
        end = time.perf_counter()
        assert result.completion_tokens == tokens, f"client {i} got {result.completion_tokens} of {tokens} tokens"
        ttft[i] = first[0] - start
        rates[i] = (tokens - 1) / (end - first[0])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, ttft, rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", default=None, help="comma-separated --max-batch values (default: 1,CLIENTS)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    args = parser.parse_args()

    loaded = load(args.model, "auto", args.dtype, args.threads)
    loaded.tokenizer.stop_ids = set()  # exactly --tokens per client
    prompts = [
        loaded.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))) for i in range(args.clients)
    ]
    info = machine_info(loaded.device)
    print(
        f"# {info['device']} | torch {info['torch']} | {loaded.path.name} {args.dtype} | "
        f"{'compiled' if args.compile else 'eager'} | {args.clients} clients x {args.tokens} tokens"
    )
    print("| max batch | aggregate tok/s | per-client tok/s | median TTFT ms | decode steps | warm-up s |")
    print("|---:|---:|---:|---:|---:|---:|")
    batches = [int(b) for b in (args.batches or f"1,{args.clients}").split(",")]
    for batch in batches:
        engine = Engine(
            loaded.model,
            loaded.tokenizer,
            max_batch=batch,
            max_queue=args.clients,
            max_seq_len=args.max_seq_len,
            compile=args.compile,
        ).start()
        warmup_s = engine.warmup()
        runs = []
        for _ in range(args.repeats):
            steps = engine.stats().decode_steps
            wall, ttft, rates = run_clients(engine, prompts, args.tokens)
            runs.append(
                (
                    args.clients * args.tokens / wall,
                    statistics.median(rates),
                    statistics.median(ttft),
                    engine.stats().decode_steps - steps,
                )
            )
        engine.shutdown()
        agg, rate, ttft, steps = sorted(runs)[len(runs) // 2]
        print(f"| {batch} | {agg:.1f} | {rate:.1f} | {ttft * 1000:.0f} | {steps} | {warmup_s:.0f} |", flush=True)
        torch._dynamo.reset()  # the next engine's graphs are for another batch size


if __name__ == "__main__":
    main()
