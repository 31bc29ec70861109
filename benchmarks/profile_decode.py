"""Where a compiled decode step's time goes: torch profiler table over 32 greedy tokens.

python benchmarks/profile_decode.py [--model PATH] [--dtype bfloat16] [--quant int4 [--group-size 32]]
"""

import argparse

from torch.profiler import ProfilerActivity, profile

from genfast.llm.session import load
from genfast.llm.speculative import make_generator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--quant", default="none")
    parser.add_argument("--group-size", type=int, default=None)
    args = parser.parse_args()
    loaded = load(args.model, "cpu", args.dtype, quant=args.quant, group_size=args.group_size)
    generator = make_generator(loaded, 512, 1, compile=True)
    generator.warmup()
    prompt = loaded.tokenizer.encode("The capital of France is")
    for _ in range(3):
        result = generator.generate([prompt], 128, stop_at_eos=False)
        print(f"decode {result.decode_tok_s:.1f} tok/s, prefill {result.prefill_tok_s:.0f} tok/s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = generator.generate([prompt], args.tokens, stop_at_eos=False)
    print(f"profiled: {result.decode_steps} decode steps in {result.decode_s * 1e3:.1f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
