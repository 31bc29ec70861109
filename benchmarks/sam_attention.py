"""SAM vit_b's attention shapes in bf16: SDPA with the materialized relative-position bias (as the
sdpa step runs it) against genfast's fused kernel; median ms of 7 calls, max error vs fp32 math.

    python benchmarks/sam_attention.py
"""

import torch

from genfast.bench.machine import device_name
from genfast.bench.timing import median_seconds
from genfast.sam import fused_attention as kernels
from genfast.sam.modeling.attention import rel_pos_attention

SHAPES = {"global block (12 heads, 64x64 grid)": (1, 12, 64, 64), "windowed block (25 windows x 12 heads, 14x14)": (25, 12, 14, 14)}


def median_ms(fn, repeats: int = 7) -> float:
    return 1000 * median_seconds(fn, repeats)


def main() -> None:
    print(f"{device_name(torch.device('cpu'))}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"fused kernel: {kernels.unavailable_reason() or 'available'}")
    print("| shape | SDPA + bias ms | fused ms | SDPA max err | fused max err |\n|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (b, heads, h, w) in SHAPES.items():
            n = h * w
            q, k, v = (torch.randn(b, heads, n, 64, generator=gen).bfloat16() for _ in range(3))
            rel_h = torch.randn(b, heads, n, h, generator=gen).bfloat16()
            rel_w = torch.randn(b, heads, n, w, generator=gen).bfloat16()
            reference = rel_pos_attention(*(t.float() for t in (q, k, v, rel_h, rel_w)), "math")
            cells = []
            for impl in ("sdpa", "fused"):
                cells.append(median_ms(lambda: rel_pos_attention(q, k, v, rel_h, rel_w, impl)))
            errors = [(rel_pos_attention(q, k, v, rel_h, rel_w, impl).float() - reference).abs().max().item()
                      for impl in ("sdpa", "fused")]
            print(f"| {name} | {cells[0]:.1f} | {cells[1]:.1f} | {errors[0]:.4f} | {errors[1]:.4f} |")


if __name__ == "__main__":
    main()
