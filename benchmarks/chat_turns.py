"""Chat-turn time to first token with and without reusing the conversation's KV cache.

    python benchmarks/chat_turns.py [--model PATH] [--system-tokens 1000] [--turns 4]
                                    [--new-tokens 32] [--repeats 3]

A conversation as `genfast chat` holds it: a long system prompt (pydoc text), then user turns,
each prompt the chat template over the whole history. The same conversation is run with
`Generator.reuse_prefix` off (every turn prefills everything, as before) and on (each turn
prefills what follows the previous turn's cache), alternately, on one compiled bf16 generator.
Prints per turn: prompt tokens, tokens found in the cache, median time to first token of each.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from genfast.bench.machine import machine_info
from genfast.llm.corpus import pydoc_text
from genfast.llm.decoding.generate import Generator
from genfast.llm.session import load

QUESTIONS = ["What does this text describe?", "Give one example.", "Why is that useful?", "Summarize it briefly."]


def conversation(gen: Generator, system: str, turns: int, new_tokens: int, reuse: bool) -> list[tuple[int, int, float]]:
    """(prompt tokens, cached tokens, time to first token) of each turn."""
    gen.reuse_prefix, gen.cached_tokens = reuse, []
    history = [{"role": "system", "content": system}]
    out = []
    for i in range(turns):
        history.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        ids = gen.tokenizer.encode(gen.tokenizer.apply_chat_template(history))
        result = gen.generate([ids], new_tokens, stop_at_eos=False)
        history.append({"role": "assistant", "content": result.texts[0]})
        out.append((result.prompt_tokens, result.cached_prompt_tokens, result.ttft_s))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    info = machine_info("cpu")
    print(f"{info['device']} ({info['isa']}), torch {info['torch']}, {torch.get_num_threads()} threads")
    loaded = load(args.model, "cpu", "bfloat16")
    tok = loaded.tokenizer
    system = tok.decode(tok.encode(pydoc_text())[: args.system_tokens])
    gen = Generator(loaded.model, tok, max_seq_len=args.system_tokens + 64 * args.turns + 256, compile=True)
    print(f"compiling: {gen.warmup():.0f} s", flush=True)
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(args.repeats):  # alternating, so a busy host slows both alike
        for reuse in (False, True):
            runs[reuse].append(conversation(gen, system, args.turns, args.new_tokens, reuse))
    print("\n| turn | prompt tokens | cached | TTFT, prefill all (ms) | TTFT, cache reused (ms) | speed-up |")
    print("|---|---|---|---|---|---|")
    for turn in range(args.turns):
        plain = statistics.median(r[turn][2] for r in runs[False]) * 1000
        reused = statistics.median(r[turn][2] for r in runs[True]) * 1000
        prompt, cached, _ = runs[True][0][turn]
        print(f"| {turn + 1} | {prompt} | {cached} | {plain:.0f} | {reused:.0f} | {plain / reused:.1f}x |")


if __name__ == "__main__":
    main()
