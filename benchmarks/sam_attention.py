"""SAM vit_b's attention shapes, each way genfast computes the relative-position bias: the
explicit softmax (as the original computes it), SDPA with the bias materialized (the sdpa step),
the bias folded into SDPA's product, FlexAttention's score_mod (CUDA) and the native fused kernel
(CPU); median ms of 7 calls, max error against the fp32 explicit softmax.

    python benchmarks/sam_attention.py [--device cpu|cuda] [--dtype bfloat16|float32]

On CPU the default dtype is the one the loaded kernel variant computes in (bf16 on AVX512-BF16,
fp32 on AVX2); on CUDA bf16. FlexAttention is compiled on its own, as `rel_pos_attention` calls it
outside torch.compile; the other ways run eagerly.
"""

import argparse

import torch

from genfast.bench.machine import describe_machine, machine_info
from genfast.bench.timing import median_seconds
from genfast.kernels.rel_pos_attention import ops as kernels
from genfast.platform.hardware import resolve_device, synchronize
from genfast.sam.modeling.attention import rel_pos_attention

SHAPES = {
    "global block (12 heads, 64x64 grid)": (1, 12, 64, 64),
    "windowed block (25 windows x 12 heads, 14x14)": (25, 12, 14, 14),
}
IMPLS = {"cpu": ("math", "sdpa", "folded", "fused"), "cuda": ("math", "sdpa", "folded", "flex")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    args = parser.parse_args()
    device = resolve_device(args.device)
    isa = kernels.loaded_isa()
    if args.dtype != "auto":
        dtype = getattr(torch, args.dtype)
    else:
        dtype = kernels.DTYPES[isa][0] if isa and device.type == "cpu" else torch.bfloat16
    impls = IMPLS[device.type]
    print(f"{describe_machine(machine_info(device))}, {torch.get_num_threads()} threads, {dtype}")
    if device.type == "cpu":
        print(f"fused kernel: {kernels.unavailable_reason() or f'{isa} variant'}")
    print("| shape | " + " | ".join(f"{impl} ms" for impl in impls) + " | " +
          " | ".join(f"{impl} max err" for impl in impls[1:]) + " |")  # fmt: skip
    print("|---|" + "---|" * (2 * len(impls) - 1))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (b, heads, h, w) in SHAPES.items():
            n, c = h * w, 64
            q, k, v = (torch.randn(b, heads, n, c, generator=gen).to(device, dtype) for _ in range(3))
            rel_h = torch.randn(b, heads, n, h, generator=gen).to(device, dtype)
            rel_w = torch.randn(b, heads, n, w, generator=gen).to(device, dtype)
            inputs = (q, k, v, rel_h, rel_w)
            reference = rel_pos_attention(*(t.float() for t in inputs), "math")

            def call(impl: str) -> None:
                rel_pos_attention(*inputs, impl)
                synchronize(device)

            ms = [1000 * median_seconds(lambda impl=impl: call(impl), 7) for impl in impls]
            errors = [(rel_pos_attention(*inputs, impl).float() - reference).abs().max().item() for impl in impls[1:]]
            print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in ms) + " | " +
                  " | ".join(f"{e:.1e}" for e in errors) + " |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
