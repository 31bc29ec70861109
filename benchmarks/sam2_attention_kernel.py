"""SAM 2's attention shapes on genfast's native attention kernel: each product in bf16, as fp32 FMAs
of the bf16 operands, or on int8 codes, against SDPA in bf16 and in fp32 (the casts included),
with the output error against fp32 SDPA.

    python benchmarks/sam2_attention_kernel.py

Shapes (batch, heads, queries, keys, head dim, value channels): a Hiera-tiny global block, the
memory attention over seven frames' memories (its values projected to the head's 256 channels,
and the memory's own 64 channels that the model passes where the kernel takes them, projecting
after the attention: genfast/sam/sam2/modeling/memory.py), a stage-3 window, and the mask
decoder's image-to-token attention (few keys). SDPA's columns take values as wide as the keys
(its CPU flash kernel needs them so): on the 64-channel row they are what the model runs without
the reassociation. Random bf16 inputs; the variants alternate in one process, median of --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {
    "Hiera global block": (1, 4, 4096, 4096, 96, 96),
    "memory attention, 7 frames": (1, 1, 4096, 28736, 256, 256),
    "memory attention, 7 frames, 64-channel values": (1, 1, 4096, 28736, 256, 64),
    "Hiera window": (25, 4, 196, 196, 96, 96),
    "decoder image-to-token": (4, 8, 4096, 8, 16, 16),
}
# (int8 scores, int8 values, fp32 products)
VARIANTS = {
    "bf16": (False, False, False),
    "fp32 products": (False, False, True),
    "int8 scores": (True, False, False),
    "both int8": (True, True, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    from genfast.kernels.rel_pos_attention import ops as kernel
    from genfast.platform.hardware import describe_isa

    reason = kernel.unavailable_reason()
    if reason:
        raise SystemExit(f"no native attention kernel here: {reason}")
    from genfast.platform.hardware import fast_bf16_products

    variants = VARIANTS if kernel.has_int8_products() else {"bf16": (False, False, False)}
    machine = (
        f"{describe_isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"fast_bf16_products: {fast_bf16_products()}, the kernel's default fp32 products: {kernel.fp32_products()}"
    )
    print(f"\n{machine}; ms, median of {args.repeats}\n")
    print("| shape | " + " | ".join(f"{name} ms (error)" for name in variants) + " | SDPA ms | SDPA fp32 ms |")
    print("|---" * (len(variants) + 3) + "|")
    gen = torch.Generator().manual_seed(0)
    for label, (b, h, nq, nk, c, cv) in SHAPES.items():
        q = torch.randn(b, h, nq, c, generator=gen).bfloat16()
        k, wide_v = (torch.randn(b, h, nk, c, generator=gen).bfloat16() for _ in range(2))
        v = wide_v if cv == c else torch.randn(b, h, nk, cv, generator=gen).bfloat16()
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        wide_expected = expected if cv == c else F.scaled_dot_product_attention(q.float(), k.float(), wide_v.float())
        calls = {
            name: (lambda flags=flags: kernel.attention(q, k, v, c**-0.5, *flags)) for name, flags in variants.items()
        }
        calls["SDPA"] = lambda: F.scaled_dot_product_attention(q, k, wide_v)
        calls["SDPA fp32"] = lambda: F.scaled_dot_product_attention(q.float(), k.float(), wide_v.float()).bfloat16()
        references = {name: wide_expected if name.startswith("SDPA") else expected for name in calls}
        errors = {
            name: ((call().float() - references[name]).norm() / references[name].norm()).item()
            for name, call in calls.items()
        }
        seconds: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
        cells = [f"{statistics.median(seconds[name]) * 1e3:.2f} ({errors[name]:.2%})" for name in variants]
        print(
            f"| {label} {list((b, h, nq, nk, c, cv))} | "
            + " | ".join(cells)
            + "".join(f" | {statistics.median(seconds[name]) * 1e3:.2f}" for name in ("SDPA", "SDPA fp32"))
            + " |"
        )


if __name__ == "__main__":
    main()
