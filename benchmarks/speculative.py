"""Speculative decoding against plain decoding, interleaved in one process.

    python benchmarks/speculative.py [--model PATH] [--drafts int4,int8,layers:24,prompt-lookup]
                                     [--prompts code,chat] [-k 4] [--new-tokens 128] [--repeats 3]

Compiled bf16 target, greedy. Each repeat runs plain decoding and then every draft on the same
prompt, so a shared host's load drifts over all of them alike (`genfast bench llm --steps
speculative` runs each row in its own process instead). Prints per prompt and draft: median
decode tok/s, speed-up over plain, acceptance, tokens per target pass, the drafting share of
decode time and whether the tokens equal plain decoding's; then the cost of one verify pass
(k+1 tokens) and of one plain step, timed alone at the same cache length.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from genfast.bench.machine import machine_info
from genfast.llm.bench import benchmark_prompt
from genfast.llm.decoding.generate import positions
from genfast.llm.decoding.sampling import SamplingParams
from genfast.llm.decoding.speculative import make_generator
from genfast.llm.session import load


@torch.inference_mode()  # as in generate(): the compiled graphs were made for it
def step_costs(gen, plain, k: int, pos: int, calls: int = 30) -> tuple[float, float]:
    """Median ms of a plain one-token step and of a (k+1)-token verify pass at slot `pos`."""
    params, device = SamplingParams(), plain.device
    one_pos, one_mask = positions(plain, pos, 1)
    many_pos, many_mask = positions(gen, pos, k + 1)
    q = torch.full((k, gen.model.args.vocab_size), 1.0 / gen.model.args.vocab_size, device=device)
    one, many = [], []
    for i in range(calls):  # interleaved, for the same reason as the generations
        t0 = time.perf_counter()
        plain._step(torch.zeros(1, 1, dtype=torch.long), one_pos, one_mask, params, steady=i > 0)
        one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        gen._run_verify(torch.zeros(1, k + 1, dtype=torch.long), many_pos, many_mask, q, params, steady=i > 0)
        many.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(one), 1e3 * statistics.median(many)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--drafts", default="int4,int8,layers:24,prompt-lookup")
    parser.add_argument("--prompts", default="code,chat")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    info = machine_info(torch.device("cpu"))
    print(
        f"{info['device']}, torch {info['torch']}; k={args.k}, {args.new_tokens} new tokens, median of {args.repeats}",
        flush=True,
    )

    loaded = load(args.model, "cpu", "bfloat16")
    max_seq = args.prompt_tokens + args.new_tokens + 64
    plain = make_generator(loaded, max_seq, 1, True)
    gens = {"plain": plain}
    for draft in args.drafts.split(","):
        gens[draft] = make_generator(loaded, max_seq, 1, True, draft, args.k)
    for name, gen in gens.items():
        print(f"compiling {name}: {gen.warmup():.0f} s", flush=True)

    for kind in args.prompts.split(","):
        prompt = benchmark_prompt(loaded.tokenizer, args.prompt_tokens, kind)
        runs: dict[str, list] = {name: [] for name in gens}
        for _ in range(args.repeats):
            for name, gen in gens.items():
                runs[name].append(gen.generate([prompt], args.new_tokens, stop_at_eos=False))
        base = statistics.median(r.decode_tok_s for r in runs["plain"])
        want = runs["plain"][0].token_ids[0]
        print(f"\nprompt {kind} ({len(prompt)} tokens)\n")
        print(
            "| decoding | decode tok/s | vs plain | drafts accepted | tokens/target pass | drafting share "
            "| same tokens as plain |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, results in runs.items():
            rate = statistics.median(r.decode_tok_s for r in results)
            r = results[0]
            same = next((i for i, (a, b) in enumerate(zip(r.token_ids[0], want)) if a != b), len(want))
            spec = name != "plain"
            print(
                f"| {name} | {rate:.1f} | {rate / base:.2f} | "
                f"{f'{r.acceptance_rate:.0%}' if spec else '-'} | {f'{r.tokens_per_pass:.2f}' if spec else '-'} | "
                f"{f'{r.draft_s / r.decode_s:.0%}' if spec else '-'} | {same}/{len(want)} |",
                flush=True,
            )

    fallbacks = {
        name: g.guard_fallbacks + getattr(getattr(g, "drafter", None), "steps", g).guard_fallbacks * (g is not plain)
        for name, g in gens.items()
    }
    print(f"\nsteady steps retried with all guards: {fallbacks}")
    spec = next((g for name, g in gens.items() if name != "plain"), None)  # any: verify ignores the drafter
    if spec is not None:
        pos = args.prompt_tokens + args.new_tokens // 2
        one, many = step_costs(spec, plain, args.k, pos)
        print(
            f"\nat {pos} cached tokens: plain step {one:.1f} ms, verify of {args.k + 1} tokens {many:.1f} ms "
            f"({many / one:.2f}x)"
        )


if __name__ == "__main__":
    main()
