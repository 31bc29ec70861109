"""Where a compiled decode step's time goes: torch profiler table over greedy decode tokens.

python benchmarks/profile_decode.py [--model PATH] [--dtype bfloat16] [--quant int4 [--group-size 32]]
    [--prompt-tokens 512] [--cache-dtype float32] [--kernels]

--kernels names inductor's generated CPU loops in the table (TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE;
set before torch compiles anything, and with a fresh inductor cache so the loops are regenerated);
otherwise the compiled step is one row. --cache-dtype overrides the KV cache's dtype that `--dtype`
chose (`Transformer.cache_dtype`), to compare a bf16 cache with an fp32 one in the same model.
Without either, it profiles the steps `genfast generate` runs (saved ahead-of-time compiled
steps, no dynamo cache lookup per step); with either, torch.compile's lazy path.
"""

import argparse
import os
import tempfile

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from genfast.compilation.inductor import use_persistent_cache
from genfast.llm.decoding.precompiled import attach
from genfast.llm.decoding.sampling import SamplingParams
from genfast.llm.decoding.speculative import make_generator
from genfast.llm.session import load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=None, help="a prompt of this many tokens")
    parser.add_argument("--quant", default="none")
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--kernels", action="store_true", help="one row per generated loop")
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    if args.kernels:
        os.environ["TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE"] = "1"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="profile-decode-inductor-")
        inductor_config.cpp.enable_kernel_profile = True
    use_persistent_cache()  # inductor's cache per kind of CPU (and ISA cap), as the CLI keeps it
    loaded = load(args.model, "cpu", args.dtype, quant=args.quant, group_size=args.group_size)
    if args.cache_dtype is not None:
        loaded.model.cache_dtype = getattr(torch, args.cache_dtype)
    prompt = loaded.tokenizer.encode("The capital of France is")
    if args.prompt_tokens:
        prompt = (prompt * (args.prompt_tokens // len(prompt) + 1))[: args.prompt_tokens]
    generator = make_generator(loaded, len(prompt) + 128 + args.tokens, 1, compile=True)
    # The steps `genfast generate` runs: compiled ahead of time, loaded from disk (or compiled here).
    # Not with --kernels (the loops must be compiled afresh, with profiling on) or --cache-dtype
    # (the saved steps' key does not hold it): those keep torch.compile's lazy path.
    if not args.kernels and args.cache_dtype is None:
        attach(generator, loaded, SamplingParams(), print)
    generator.warmup()
    cache = loaded.model.layers[0].attention.kv_cache.k
    print(f"KV cache {cache.dtype}, prompt {len(prompt)} tokens")
    for _ in range(3):
        result = generator.generate([prompt], 128, stop_at_eos=False)
        print(f"decode {result.decode_tok_s:.1f} tok/s, prefill {result.prefill_tok_s:.0f} tok/s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = generator.generate([prompt], args.tokens, stop_at_eos=False)
    print(f"profiled: {result.decode_steps} decode steps in {result.decode_s * 1e3:.1f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
