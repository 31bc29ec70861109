"""What batch-invariant mode (genfast/llm/model/invariance.py) costs: the same model loaded with it
and without, compiled, timed in turns in one process, so that a shared host's drifting speed falls
on both alike.

    python benchmarks/batch_invariance.py [--model PATH] [--prompt-tokens 128,1024] [--new-tokens 64]
        [--rounds 5] [--batch 8]

Per prompt length: prefill tok/s and decode tok/s of one request (`genfast generate`'s path), then
the aggregate tok/s of `--batch` concurrent requests of the serving engine (`genfast serve`'s path;
the same prompts for both modes). Medians over --rounds; each round times both modes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from genfast.bench.machine import describe_machine, machine_info
from genfast.llm.corpus import pydoc_text
from genfast.llm.decoding.generate import Generator
from genfast.llm.loading import load
from genfast.serve.engine import Engine, GenerationRequest

MODES = {"library kernels": False, "batch-invariant": True}


def serve_rate(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    """All prompts at once; every request's tokens over the wall time."""
    done: list[int] = []
    start = time.perf_counter()

    def client(prompt: list[int]) -> None:
        done.append(engine.generate(GenerationRequest(tuple(prompt), tokens)).completion_tokens)

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-tokens", default="128,1024")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the rows here (docs/performance.md's format)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    max_seq = max(lengths) + args.new_tokens + 8

    def loaded_model(invariant: bool):
        loaded = load(args.model, "auto", "auto", batch_invariant=invariant)
        loaded.tokenizer.stop_ids = set()  # exactly --new-tokens per request
        return loaded

    rows = {(n, name): {} for n in lengths for name in MODES}
    generators = {}
    for name, invariant in MODES.items():
        loaded = loaded_model(invariant)
        generators[name] = Generator(loaded.model, loaded.tokenizer, max_seq_len=max_seq)
    text = loaded.tokenizer.encode(pydoc_text())
    for n in lengths:
        prompt = text[:n]
        for generator in generators.values():  # the first call compiles for this length
            generator.generate([prompt], args.new_tokens, stop_at_eos=False)
        runs: dict[str, list] = {name: [] for name in MODES}
        for _ in range(args.rounds):
            for name, generator in generators.items():
                runs[name].append(generator.generate([prompt], args.new_tokens, stop_at_eos=False))
        for name in MODES:
            rows[n, name]["prefill_tok_s"] = statistics.median(r.prefill_tok_s for r in runs[name])
            rows[n, name]["decode_tok_s"] = statistics.median(r.decode_tok_s for r in runs[name])
    del generators
    torch._dynamo.reset()

    # The engines apart: an idle engine's OpenMP workers would take cores from a generator.
    engines = {}
    for name, invariant in MODES.items():
        loaded = loaded_model(invariant)
        engine = Engine(loaded.model, loaded.tokenizer, max_batch=args.batch, max_seq_len=max_seq).start()
        engine.reuse_prefixes = False  # every request prefilled whole, in both modes
        engine.warmup()
        engines[name] = engine
    for n in lengths:
        prompts = [text[i * 7 : i * 7 + n] for i in range(args.batch)]
        rates: dict[str, list[float]] = {name: [] for name in MODES}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                rates[name].append(serve_rate(engine, prompts, args.new_tokens))
        for name in MODES:
            rows[n, name]["serving_tok_s"] = statistics.median(rates[name])
    for engine in engines.values():
        engine.shutdown()

    info = machine_info(loaded.device)
    print(f"# {describe_machine(info)} | {loaded.path.name} | {loaded.dtype_label()}")
    print(
        f"# medians of {args.rounds} rounds, both modes timed in each; {args.new_tokens} new tokens per request; "
        f"serving: {args.batch} requests at once"
    )
    print("| prompt tokens | kernels | prefill tok/s | decode tok/s | serving tok/s |")
    print("|---:|---|---:|---:|---:|")
    for (n, name), row in rows.items():
        print(f"| {n} | {name} | {row['prefill_tok_s']:.0f} | {row['decode_tok_s']:.1f} | {row['serving_tok_s']:.1f} |")
    if args.json:
        described = [
            {
                "workload": "llm",
                "step": name,
                "group": ["prompt_tokens"],
                "prompt_tokens": n,
                **row,
                "serving_batch": args.batch,
                "speed_key": "prefill_tok_s",  # the chart's figure: what the mode costs where it costs
                "higher_is_faster": True,
                "source": "benchmarks/batch_invariance.py --json (both modes in turns in one process)",
                "dtype": loaded.dtype_label(),
                "model": loaded.path.name,
                "command": "python benchmarks/batch_invariance.py " + " ".join(sys.argv[1:]),
                **{k: info[k] for k in ("device", "isa", "torch")},
            }
            for (n, name), row in rows.items()
        ]
        Path(args.json).write_text(json.dumps(described, indent=1) + "\n")


if __name__ == "__main__":
    main()
