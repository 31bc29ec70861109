"""What structured output adds to a decode step: llguidance's token mask and its application.

    python benchmarks/constrained_decoding.py [--model PATH] [--repeats 5]

A json_schema reply is generated once through the serving engine (greedy); its tokens are then
replayed through a fresh matcher, timing per token the mask (`Matcher.allowed`: llguidance's
bitmask, unpacked to one bool per vocabulary entry) and its application to a logits row (what
`Engine._sample` does). The decode step it is compared with is a compiled unconstrained
generation of the same length (median tok/s of --repeats runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from genfast.bench.machine import machine_info
from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.sampling import SamplingParams
from genfast.llm.session import load
from genfast.serve.constraints import Constraints, response_format_grammar
from genfast.serve.engine import Engine, GenerationRequest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "maxLength": 8}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "pets", "address"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    loaded = load(args.model, "cpu", "auto")
    tok = loaded.tokenizer
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}]))

    engine = Engine(loaded.model, tok, max_batch=1, max_seq_len=1024, compile=False).start()
    reply = engine.generate(GenerationRequest(tuple(prompt), 200, SamplingParams(), grammar=grammar))
    engine.shutdown()
    tokens = reply.token_ids

    constraints = Constraints(tok, loaded.model.args.vocab_size)
    logits = torch.randn(1, loaded.model.args.vocab_size)
    per_token = []
    for _ in range(args.repeats):
        matcher = constraints.matcher(grammar)
        start = time.perf_counter()
        for token in tokens:
            allowed = matcher.allowed()
            logits.masked_fill(~allowed, float("-inf"))
            matcher.take(token)
        per_token.append((time.perf_counter() - start) / len(tokens))
    mask_ms = statistics.median(per_token) * 1e3

    gen = Generator(loaded.model, tok, max_seq_len=1024, compile=True)
    gen.warmup()
    rates = [gen.generate([prompt], len(tokens), stop_at_eos=False).decode_tok_s for _ in range(args.repeats)]
    step_ms = 1e3 / statistics.median(rates)

    info = machine_info("cpu")
    print(f"# {info['device']} ({info['isa']}) | torch {info['torch']} | {loaded.path.name} {loaded.dtype_label()}")
    print(f"reply ({len(tokens)} tokens, {reply.finish_reason}): {reply.text}\n")
    print("| per token | ms |")
    print("|---|---|")
    print(f"| compiled decode step | {step_ms:.2f} |")
    print(f"| mask + apply (llguidance) | {mask_ms:.3f} ({mask_ms / step_ms:.1%} of a step) |")


if __name__ == "__main__":
    main()
