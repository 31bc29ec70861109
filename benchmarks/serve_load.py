"""Aggregate decode throughput of the continuous-batching engine: N concurrent clients, with
--max-batch 1 (one request at a time) against --max-batch N (all share each decode step).

    python benchmarks/serve_load.py [--model PATH] [--dtype bfloat16] [--clients 8] [--tokens 64]
                                    [--batches 1,8] [--repeats 3] [--no-compile]
    python benchmarks/serve_load.py --shared-prefix 1000 [--model PATH] [--repeats 5]

Each client sends a different prompt and asks for exactly --tokens greedy tokens (EOS ignored).
Tokens/s is all clients' tokens over the wall time from the first submit to the last token: what
a server delivers in aggregate. Also printed: the median time to first token and the tokens/s a
single client sees. In-process (no HTTP), so it measures the engine. Compile time is excluded
(warm-up) and reported apart; each row is the median of --repeats runs.

--shared-prefix N: requests that share an N-token prefix (pydoc text, as a long system prompt)
and differ in their last words, one at a time: the time to first token of one whose prefix is
in a slot's cache row (the request before it left it there) against one prefilled whole (prefix
reuse switched off), alternately.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from genfast.bench.machine import machine_info
from genfast.llm.corpus import pydoc_text
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


def first_token_s(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, int]:
    """(seconds from submission to the first text, prompt tokens found in the cache) of one request alone."""
    first: list[float] = []
    start = time.perf_counter()
    done = engine.generate(
        GenerationRequest(tuple(prompt), tokens), on_text=lambda _: first or first.append(time.perf_counter())
    )
    return first[0] - start, done.cached_tokens


def shared_prefix(engine: Engine, tokenizer, prefix_tokens: int, tokens: int, repeats: int) -> None:
    prefix = tokenizer.encode(pydoc_text())[:prefix_tokens]
    words = ["apple", "river", "mountain", "violin", "harbor", "lantern", "meadow", "copper"]
    prompts = [prefix + tokenizer.encode(f" Question {i}: what is a {w}?") for i, w in enumerate(words * repeats)]
    uncached, cached, found = [], [], []
    for i in range(0, len(prompts) - 1, 2):
        engine.reuse_prefixes = False
        uncached.append(first_token_s(engine, prompts[i], tokens)[0])
        engine.reuse_prefixes = True  # the request above left the prefix in its row
        seconds, hit = first_token_s(engine, prompts[i + 1], tokens)
        cached.append(seconds)
        found.append(hit)
    print("| prefix tokens | cached tokens | TTFT prefilled whole ms | TTFT prefix reused ms | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    whole, reused = statistics.median(uncached) * 1000, statistics.median(cached) * 1000
    print(f"| {len(prefix)} | {statistics.median(found):.0f} | {whole:.0f} | {reused:.0f} | {whole / reused:.1f}x |")


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
    parser.add_argument("--shared-prefix", type=int, default=0, help="prefix tokens (the shared-prefix mode)")
    args = parser.parse_args()

    loaded = load(args.model, "auto", args.dtype, args.threads)
    loaded.tokenizer.stop_ids = set()  # exactly --tokens per client
    prompts = [
        loaded.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))) for i in range(args.clients)
    ]
    info = machine_info(loaded.device)
    if args.shared_prefix:
        print(f"# {info['device']} | torch {info['torch']} | {loaded.path.name} {args.dtype} | shared prefix")
        engine = Engine(loaded.model, loaded.tokenizer, max_batch=1, max_seq_len=args.shared_prefix + 64 + args.tokens,
                        compile=args.compile).start()  # fmt: skip
        print(f"warm-up {engine.warmup():.0f} s", flush=True)
        shared_prefix(engine, loaded.tokenizer, args.shared_prefix, args.tokens, args.repeats)
        engine.shutdown()
        return
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
