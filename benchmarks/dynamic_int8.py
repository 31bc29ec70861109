"""Compute-bound matmuls (SAM, SAM 2 and diffusion shapes) on this machine: fp32, bf16, torch._int_mm
and genfast's two native int8 kernels, in GFLOP/s (median of 5), and whether genfast takes this
CPU's bf16 products to be faster than its fp32 ones (`hardware.fast_bf16_products`: on an Intel
Xeon without AMX they are not, and SAM 2's bf16 layers multiply in fp32):

    python benchmarks/dynamic_int8.py

`torch._int_mm` is timed on ready int8 operands; the native kernels include quantizing their
inputs: `qlinear` (activations per block of 32, the weight-only path) and `qlinear_dynamic`
(per-token activations, the dynamic int8 path).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from genfast.bench.machine import device_name
from genfast.bench.timing import median_seconds
from genfast.kernels.qlinear import ops as kernels
from genfast.platform import hardware
from genfast.quant.grids import quantize

SHAPES = [
    (4096, 768, 2304),
    (4096, 768, 3072),
    (4096, 3072, 768),
    (32768, 768, 2304),
    (1024, 320, 1280),
    (128, 576, 1536),
    (16384, 96, 384),  # Hiera-tiny's 1/4 stage: K too narrow for int8 (SAM's INT8_MIN_FEATURES)
    (8192, 768, 192),  # its 1/8 stage's MLP output
]


def gflops(fn: Callable[[], object], flops: float, repeats: int = 5) -> float:
    return flops / median_seconds(fn, repeats) / 1e9


def main() -> None:
    native = kernels.unavailable_reason() is None
    print(f"{device_name(torch.device('cpu'))}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    faster = "bf16" if hardware.fast_bf16_products() else "fp32"
    print(f"genfast takes {faster} products to be the faster here (genfast.platform.hardware.fast_bf16_products)")
    print(
        "| M x K x N | fp32 mm | bf16 mm | torch._int_mm | native qlinear | native qlinear_dynamic |\n"
        "|---|---|---|---|---|---|"
    )
    with torch.inference_mode():
        for m, k, n in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k)
            xb, wb = x.bfloat16(), w.bfloat16()
            xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
            wq = torch.randint(-127, 128, (k, n), dtype=torch.int8)
            flops = 2 * m * k * n
            row = [
                gflops(lambda: x @ w.t(), flops),
                gflops(lambda: xb @ wb.t(), flops),
                gflops(lambda: torch._int_mm(xq, wq), flops),
            ]
            if native:
                qw = quantize(w, 8)
                rows = -(-n // kernels.ROW_GROUP) * kernels.ROW_GROUP
                pad = lambda t: F.pad(t, (0, 0, 0, rows - t.shape[0]))  # noqa: E731
                packed = kernels.pack(pad(qw.codes), pad(qw.scales), pad(qw.mins), 8)
                row.append(gflops(lambda: torch.ops.genfast.qlinear(xb, packed, 8, qw.group_size, n), flops))
                row.append(gflops(lambda: torch.ops.genfast.qlinear_dynamic(xb, packed, n), flops))
            cells = " | ".join(f"{v:.0f}" for v in row) + ("" if native else " | - | -")
            print(f"| {m} x {k} x {n} | {cells} |")


if __name__ == "__main__":
    main()
