"""Decode attention over a KV cache: the native kernel against inductor's compiled fallback.

python benchmarks/decode_attention.py [--keys 64,512,2048,8192] [--heads 9] [--kv-heads 3]
    [--head-dim 64] [--cache-dtype bfloat16] [--threads 2]

One query per head over `keys` cached positions (SmolLM2's shape by default), fp32 queries; median
of 7 runs of 200 calls each. GB/s counts the keys' and values' bytes once. The cache is a slice of
a longer buffer, as in decode, and stays in cache between calls here (inside a decode step the
weights evict it: expect less there, see docs/notes.md, "Decode attention").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from genfast.compilation.inductor import use_persistent_cache
from genfast.kernels.decode_attention import ops as decode_attention


def timed(fn, *args) -> float:
    for _ in range(20):
        fn(*args)
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(200):
            fn(*args)
        runs.append((time.perf_counter() - start) / 200)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", default="64,512,2048,8192")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    use_persistent_cache()  # inductor's cache per kind of CPU (and ISA cap), as the CLI keeps it
    torch.set_num_threads(args.threads)
    if (why := decode_attention.KERNEL.unavailable_reason()) is not None:
        raise SystemExit(f"no native decode attention here: {why}")
    variant, _ = decode_attention.KERNEL.choose()
    fallback = torch.compile(decode_attention.portable, fullgraph=True, dynamic=False)
    dtype = getattr(torch, args.cache_dtype)
    print(f"{args.heads} heads over {args.kv_heads} KV heads of {args.head_dim}, {args.cache_dtype} cache, "
          f"{args.threads} threads, kernel variant {variant.isa}")  # fmt: skip
    print("| keys | kernel us | GB/s | inductor us | GB/s | max abs diff |")
    print("|---|---|---|---|---|---|")
    for keys in (int(k) for k in args.keys.split(",")):
        q = torch.randn(1, args.heads, 1, args.head_dim)
        cache = torch.randn(2, 1, args.kv_heads, keys + 64, args.head_dim).to(dtype)
        k, v = cache[0, :, :, :keys], cache[1, :, :, :keys]
        mask = torch.ones(1, 1, 1, keys, dtype=torch.bool)
        scale = args.head_dim**-0.5
        native = timed(decode_attention.decode_attention, q, k, v, mask, scale)
        compiled = timed(fallback, q, k, v, mask, scale)
        portable = fallback(q, k, v, mask, scale)
        diff = (decode_attention.decode_attention(q, k, v, mask, scale) - portable).abs().max().item()
        size = 2 * k.numel() * k.element_size()
        print(f"| {keys} | {native * 1e6:.1f} | {size / native / 1e9:.1f} | {compiled * 1e6:.1f} | "
              f"{size / compiled / 1e9:.1f} | {diff:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
