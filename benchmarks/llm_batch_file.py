"""`genfast generate --input` against one prompt per `genfast generate` call: the same N prompts
(default 64), each asking for exactly --new-tokens greedy tokens (EOS ignored), in one process.

    python benchmarks/llm_batch_file.py [--model smollm2-135m-instruct] [--prompts 64]
                                        [--new-tokens 64] [--dtype float32] [--max-batch 16]

One at a time: a compiled batch-1 Generator (what each `genfast generate` call runs once loaded):
its decode rate (tokens after the first over decode seconds, as `generate` prints it) and its
wall rate (every token over prefill + decode). The file: `run_batch_file`, what `--input` runs,
on the compiled continuous-batching engine with --max-batch slots: every answer's tokens over the
wall time from the first submit to the last answer written (prefills included). Compile time is
excluded from both (warm-ups). Also checked: the greedy answers are the same text both ways.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from genfast.bench.machine import describe_machine, machine_info
from genfast.llm.recipe import apply_recipe, make_generator, plan
from genfast.serve.batch_file import run_batch_file
from genfast.serve.engine import Engine

TOPICS = ("the sea", "a library", "winter", "trains", "bread", "the moon", "music", "a garden")


def prompts(n: int) -> list[str]:
    """n different prompts of 8-20 words."""
    return [
        f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}, number {i}, "
        + "in plain words " * (i % 5)
        + "for a child."
        for i in range(n)
    ]


def one_at_a_time(model: str, dtype: str, texts: list[str], new_tokens: int) -> tuple[list[str], float, float]:
    """(answers, decode tok/s, wall tok/s) of a compiled batch-1 Generator, one prompt per call."""
    settings = plan("compile", "cpu", dtype).settings
    loaded = apply_recipe(model, settings, "cpu")
    generator = make_generator(loaded, None, 1, True)
    ids = [generator.encode_prompt(t) for t in texts]
    generator.generate([ids[0]], new_tokens, stop_at_eos=False)  # compile (warm-up)
    answers, decode_tokens, decode_s, wall_s = [], 0, 0.0, 0.0
    for prompt in ids:
        result = generator.generate([prompt], new_tokens, stop_at_eos=False)
        answers.append(result.texts[0])
        decode_tokens += result.new_tokens - 1
        decode_s += result.decode_s
        wall_s += result.prefill_s + result.decode_s
    return answers, decode_tokens / decode_s, len(ids) * new_tokens / wall_s


def from_file(model: str, dtype: str, texts: list[str], new_tokens: int, max_batch: int) -> tuple[list[str], float]:
    """(answers in input order, tok/s) of the --input path on the compiled engine."""
    settings = plan("compile", "cpu", dtype).settings
    loaded = apply_recipe(model, settings, "cpu")
    engine = Engine(loaded.model, loaded.tokenizer, max_batch=max_batch, max_queue=2 * max_batch, compile=True)
    engine.start()
    engine.warmup()
    tokenizer = loaded.tokenizer
    # EOS ignored as in the other path: no stop ids, so every answer has exactly new_tokens.
    tokenizer.stop_ids = set()
    defaults = dict(max_new_tokens=new_tokens, temperature=0.0, top_k=None, top_p=None, seed=None, stop=[])
    with tempfile.TemporaryDirectory() as name:
        source, target = Path(name) / "in.jsonl", Path(name) / "out.jsonl"
        source.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in enumerate(texts)))
        start = time.perf_counter()
        summary = run_batch_file(engine, source, target, defaults)
        seconds = time.perf_counter() - start
        records = {r["id"]: r for r in map(json.loads, target.read_text().splitlines())}
    engine.shutdown()
    assert summary.done == len(texts) and not summary.failed, summary.line()
    tokens = sum(r["usage"]["completion_tokens"] for r in records.values())
    return [records[i]["text"] for i in range(len(texts))], tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-batch", type=int, default=16)
    args = parser.parse_args()
    texts = prompts(args.prompts)
    print(f"{describe_machine(machine_info('cpu'))}; {args.model} in {args.dtype}, "
          f"{args.prompts} prompts x {args.new_tokens} greedy tokens")  # fmt: skip
    single, decode_rate, single_wall = one_at_a_time(args.model, args.dtype, texts, args.new_tokens)
    batched, file_rate = from_file(args.model, args.dtype, texts, args.new_tokens, args.max_batch)
    same = sum(a == b for a, b in zip(single, batched, strict=True))
    print("| path | tok/s | vs one-at-a-time decode |")
    print("|---|---|---|")
    print(f"| one prompt per call: decode rate | {decode_rate:.1f} | 1.00 |")
    print(f"| one prompt per call: wall (prefill + decode) | {single_wall:.1f} | {single_wall / decode_rate:.2f} |")
    print(f"| --input, --max-batch {args.max_batch} | {file_rate:.1f} | {file_rate / decode_rate:.2f} |")
    print(f"same greedy answers: {same}/{len(texts)}")


if __name__ == "__main__":
    main()
