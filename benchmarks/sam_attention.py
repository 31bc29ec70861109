"""SAM vit_b's attention shapes: the explicit softmax (as the original computes it), SDPA with the
materialized relative-position bias (the sdpa step) and genfast's fused kernel; median ms of 7
calls, the fused kernel's GFLOP/s (2 products of 2 N^2 C FLOPs per head), max error vs fp32 math.

    python benchmarks/sam_attention.py [--dtype bfloat16|float32]

The default dtype is the one the loaded kernel variant computes in (bf16 on AVX512-BF16, fp32 on AVX2).
"""

import argparse

import torch

from genfast.bench.machine import describe_machine, machine_info
from genfast.bench.timing import median_seconds
from genfast.sam import fused_attention as kernels
from genfast.sam.modeling.attention import rel_pos_attention

SHAPES = {
    "global block (12 heads, 64x64 grid)": (1, 12, 64, 64),
    "windowed block (25 windows x 12 heads, 14x14)": (25, 12, 14, 14),
}
IMPLS = ("math", "sdpa", "fused")


def median_ms(fn, repeats: int = 7) -> float:
    return 1000 * median_seconds(fn, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    args = parser.parse_args()
    isa = kernels.loaded_isa()
    if args.dtype == "auto":
        dtype = kernels.DTYPES[isa][0] if isa else torch.bfloat16
    else:
        dtype = getattr(torch, args.dtype)
    print(f"{describe_machine(machine_info(torch.device('cpu')))}, {torch.get_num_threads()} threads, {dtype}")
    print(f"fused kernel: {kernels.unavailable_reason() or f'{isa} variant'}")
    print("| shape | math ms | SDPA + bias ms | fused ms | fused GFLOP/s | SDPA max err | fused max err |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (b, heads, h, w) in SHAPES.items():
            n, c = h * w, 64
            q, k, v = (torch.randn(b, heads, n, c, generator=gen).to(dtype) for _ in range(3))
            rel_h = torch.randn(b, heads, n, h, generator=gen).to(dtype)
            rel_w = torch.randn(b, heads, n, w, generator=gen).to(dtype)
            reference = rel_pos_attention(*(t.float() for t in (q, k, v, rel_h, rel_w)), "math")
            ms = {impl: median_ms(lambda: rel_pos_attention(q, k, v, rel_h, rel_w, impl)) for impl in IMPLS}
            errors = {
                impl: (rel_pos_attention(q, k, v, rel_h, rel_w, impl).float() - reference).abs().max().item()
                for impl in ("sdpa", "fused")
            }
            gflop_s = 4 * b * heads * n * n * c / (ms["fused"] / 1000) / 1e9
            print(
                f"| {name} | {ms['math']:.1f} | {ms['sdpa']:.1f} | {ms['fused']:.1f} | {gflop_s:.0f} | "
                f"{errors['sdpa']:.2e} | {errors['fused']:.2e} |"
            )


if __name__ == "__main__":
    main()
