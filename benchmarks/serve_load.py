"""Aggregate decode throughput of the continuous-batching engine: N concurrent clients, with
--max-batch 1 (one request at a time) against --max-batch N (all share each decode step).

    python benchmarks/serve_load.py [--model PATH] [--dtype bfloat16] [--clients 8] [--tokens 64]
                                    [--batches 1,8] [--repeats 3] [--no-compile] [--batch-invariant off,on]
    python benchmarks/serve_load.py --shared-prefix 1000 [--model PATH] [--repeats 5]
    python benchmarks/serve_load.py --long-prompt 2000 [--prefill-chunks 64,256,1024] [--model PATH]

Each client sends a different prompt and asks for exactly --tokens greedy tokens (EOS ignored).
Tokens/s is all clients' tokens over the wall time from the first submit to the last token: what
a server delivers in aggregate. Also printed: the median time to first token and the tokens/s a
single client sees. In-process (no HTTP), so it measures the engine. Compile time is excluded
(warm-up) and reported apart; each row is the median of --repeats runs. --batch-invariant off,on
runs every row with the model loaded both ways (genfast/llm/model/invariance.py): what that mode
costs a server, in one run.

--shared-prefix N: requests that begin with one of two N-token prefixes (pydoc text, as long
system prompts) and differ in their last words, one at a time in one slot. The time to first
token of a request prefilled whole (prefix reuse switched off), of one whose prefix its slot's
row holds (the request before it had the same prefix), and of one whose prefix the row lost to
the other prefix and the prefix cache still holds (copied into the row), in turn.

--long-prompt N: one client decodes while an N-token prompt arrives, for each --prefill-chunk
value: the running client's largest and median gap between tokens while the long prompt is
prefilled, and the long request's time to first token. Chunked prefill trades the second for
the first.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time

import torch

from genfast.bench.machine import machine_info
from genfast.llm.corpus import pydoc_text
from genfast.llm.loading import load
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
    text = tokenizer.encode(pydoc_text())
    assert len(text) >= 2 * prefix_tokens, f"the corpus has {len(text)} tokens, fewer than 2 x {prefix_tokens}"
    p, q = text[:prefix_tokens], text[prefix_tokens : 2 * prefix_tokens]
    questions = iter(itertools.count())

    def ask(prefix: list[int]) -> tuple[float, int]:
        return first_token_s(engine, prefix + tokenizer.encode(f" Question {next(questions)}: what is it?"), tokens)

    whole, row, cache = [], [], []
    for _ in range(repeats):
        engine.reuse_prefixes = False
        whole.append(ask(p))
        engine.reuse_prefixes = True
        ask(q)  # the row now holds q; the prefix cache holds both
        cache.append(ask(p))
        row.append(ask(p))
    print("| prefix tokens | path | cached tokens | TTFT ms | speed-up |")
    print("|---:|---|---:|---:|---:|")
    base = statistics.median(s for s, _ in whole)
    for name, runs in (("prefilled whole", whole), ("slot's row", row), ("prefix cache (copied)", cache)):
        ttft = statistics.median(s for s, _ in runs)
        found = statistics.median(n for _, n in runs)
        print(f"| {prefix_tokens} | {name} | {found:.0f} | {ttft * 1000:.0f} | {base / ttft:.1f}x |", flush=True)


def long_prompt(loaded, prompt_tokens: int, chunks: list[int], repeats: int, compile: bool) -> None:
    prompt = loaded.tokenizer.encode(pydoc_text())[:prompt_tokens]
    print("| prefill chunk | running client's largest gap ms | its median gap ms | long prompt's TTFT ms |")
    print("|---:|---:|---:|---:|")
    for chunk in chunks:
        engine = Engine(loaded.model, loaded.tokenizer, max_batch=2, max_seq_len=prompt_tokens + 64,
                        compile=compile, prefill_chunk=chunk).start()  # fmt: skip
        engine.warmup()
        engine.reuse_prefixes = False  # every round prefills the long prompt whole
        runs = []
        for _ in range(repeats):
            stamps: list[float] = []  # when each piece of the running client's text arrived
            running = engine.submit(
                GenerationRequest((1, 2, 3), engine.max_seq_len - 3), lambda _, s=stamps: s.append(time.perf_counter())
            )
            while len(stamps) < 5:  # decoding steadily
                time.sleep(0.01)
            submitted = time.perf_counter()
            first, _ = first_token_s(engine, prompt, 2)
            while stamps[-1] <= submitted + first:  # its first text after the long prompt's first token
                time.sleep(0.01)
            # Its gaps from the long prompt's arrival to the first text after the long one's first.
            ends = [i for i, at in enumerate(stamps) if at > submitted]
            last = next(i for i in ends if stamps[i] > submitted + first)
            gaps = [stamps[i] - stamps[i - 1] for i in range(ends[0], last + 1)]
            running.cancel()
            runs.append((max(gaps), statistics.median(gaps), first))
        engine.shutdown()
        largest, median, first = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"| {chunk} | {largest * 1000:.0f} | {median * 1000:.0f} | {first * 1000:.0f} |", flush=True)
        torch._dynamo.reset()


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
    parser.add_argument("--long-prompt", type=int, default=0, help="prompt tokens (the chunked-prefill mode)")
    parser.add_argument("--prefill-chunks", default="64,256,1024", help="--prefill-chunk values (--long-prompt)")
    parser.add_argument(
        "--batch-invariant", default="off", help="off, on or off,on: load the model so (the load mode only)"
    )
    args = parser.parse_args()
    modes = [{"off": False, "on": True}[m] for m in args.batch_invariant.split(",")]

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
    if args.long_prompt:
        print(f"# {info['device']} | torch {info['torch']} | {loaded.path.name} {args.dtype} | long prompt")
        chunks = [int(c) for c in args.prefill_chunks.split(",")]
        long_prompt(loaded, args.long_prompt, chunks, args.repeats, args.compile)
        return
    print(
        f"# {info['device']} | torch {info['torch']} | {loaded.path.name} {args.dtype} | "
        f"{'compiled' if args.compile else 'eager'} | {args.clients} clients x {args.tokens} tokens"
    )
    print(
        "| batch-invariant | max batch | aggregate tok/s | per-client tok/s | median TTFT ms | decode steps "
        "| warm-up s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    batches = [int(b) for b in (args.batches or f"1,{args.clients}").split(",")]
    for batch, invariant in itertools.product(batches, modes):
        loaded = load(args.model, "auto", args.dtype, args.threads, batch_invariant=invariant)
        loaded.tokenizer.stop_ids = set()
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
        mode = "on" if invariant else "off"
        print(
            f"| {mode} | {batch} | {agg:.1f} | {rate:.1f} | {ttft * 1000:.0f} | {steps} | {warmup_s:.0f} |", flush=True
        )
        torch._dynamo.reset()  # the next engine's graphs are for another batch size


if __name__ == "__main__":
    main()
