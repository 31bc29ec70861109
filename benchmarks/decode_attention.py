"""Decode attention over a KV cache: the native kernel against inductor's compiled fallback.

python benchmarks/decode_attention.py [--keys 64,512,2048,8192] [--heads 9] [--kv-heads 3]
    [--head-dim 64] [--cache-dtype bfloat16] [--threads 2] [--queries 128,512,2048]

One query per head over `keys` cached positions (SmolLM2's shape by default), fp32 queries; median
of 7 runs of 200 calls each. GB/s counts the keys' and values' bytes once. The cache is a slice of
a longer buffer, as in decode, and stays in cache between calls here (inside a decode step the
weights evict it: expect less there, see docs/notes.md, "Decode attention").

--queries: instead, causal prefills of S queries over S keys (S = L) each, queries in the cache's
dtype, the kernel against SDPA (`F.scaled_dot_product_attention(..., enable_gqa=True)`, the eager
prefill path) with the same boolean mask; median of 7 runs of calls adding up to ~0.1 s each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from genfast.compilation.inductor import use_persistent_cache
from genfast.kernels.decode_attention import ops as decode_attention
from genfast.llm.model.transformer import attention_mask


def timed(fn, *args, calls: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn(*args)
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def timed_long(fn, *args) -> float:
    """`timed` for calls of milliseconds: as many per run as fill ~0.1 s."""
    start = time.perf_counter()
    fn(*args)
    calls = max(1, round(0.1 / (time.perf_counter() - start)))
    return timed(fn, *args, calls=calls, warmup=2)


def prefill(args: argparse.Namespace, dtype: torch.dtype) -> None:
    print("| queries = keys | kernel ms | SDPA ms | SDPA / kernel | max abs diff |")
    print("|---|---|---|---|---|")
    for size in (int(s) for s in args.queries.split(",")):
        q = torch.randn(1, args.heads, size, args.head_dim).to(dtype)
        k, v = (torch.randn(1, args.kv_heads, size, args.head_dim).to(dtype) for _ in range(2))
        mask = attention_mask(torch.arange(size), size)  # [1, 1, S, S], causal
        scale = args.head_dim**-0.5

        def sdpa(q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        native = timed_long(decode_attention.decode_attention, q, k, v, mask, scale)
        reference = timed_long(sdpa, q, k, v, mask)
        diff = (decode_attention.decode_attention(q, k, v, mask, scale).float() - sdpa(q, k, v, mask).float()).abs()
        print(f"| {size} | {native * 1e3:.2f} | {reference * 1e3:.2f} | {reference / native:.2f} | "
              f"{diff.max().item():.1e} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", default="64,512,2048,8192")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--queries", default="", help="causal prefills of these sizes instead, e.g. 128,512,2048")
    args = parser.parse_args()
    use_persistent_cache()  # inductor's cache per kind of CPU (and ISA cap), as the CLI keeps it
    torch.set_num_threads(args.threads)
    if (why := decode_attention.KERNEL.unavailable_reason()) is not None:
        raise SystemExit(f"no native decode attention here: {why}")
    variant, _ = decode_attention.KERNEL.choose()
    dtype = getattr(torch, args.cache_dtype)
    print(f"{args.heads} heads over {args.kv_heads} KV heads of {args.head_dim}, {args.cache_dtype} cache, "
          f"{args.threads} threads, kernel variant {variant.isa}")  # fmt: skip
    if args.queries:
        prefill(args, dtype)
        return
    fallback = torch.compile(decode_attention.portable, fullgraph=True, dynamic=False)
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
