"""Quantized one-row linears (batch-1 decode) on this machine: genfast's native kernel against
torch's own int8/int4 CPU ops and bf16, on the weight matrices of one decode step (distinct
copies, so nothing stays in cache): SmolLM2-135M's 121 by default, `--shape` for another of
genfast's `random:` shapes (e.g. llama-3.2-1b). Variants take turns; medians of the later rounds:

    python benchmarks/quant_kernels.py [--threads 2] [--rounds 12] [--hot] [--shape S] [--only V,...]

--hot times one 960 x 576 matrix instead, called HOT_CALLS times per round: it stays in L2, so the
kernels' arithmetic rate shows without memory (compare with a pass to see how well a kernel hides
its loads).

The result decided genfast's CPU int8/int4 kernels (docs/notes.md, "Quantization").
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from genfast.bench.machine import device_name
from genfast.kernels.qlinear import ops as kernels
from genfast.llm.checkpoints.random_model import SHAPES, decode_step_shapes
from genfast.quant.grids import quantize

HOT_CALLS = 2000
Variant = tuple[Callable[[], object], int]  # (one pass over all matrices, bytes it reads)


def inputs(weights: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """One bf16 activation row per input width."""
    return {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {w.shape[1] for w in weights}}


def bf16_linear(weights: list[torch.Tensor]) -> Variant:
    w16 = [w.bfloat16() for w in weights]
    x = inputs(weights)
    return (lambda: [F.linear(x[w.shape[1]], w) for w in w16]), sum(w.nbytes for w in w16)


def native(weights: list[torch.Tensor], bits: int, group_size: int | None) -> Variant:
    layers = []
    for w in weights:
        qw = quantize(w, bits, group_size)
        rows = -(-qw.out_features // kernels.ROW_GROUP) * kernels.ROW_GROUP
        pad = lambda t: F.pad(t, (0, 0, 0, rows - t.shape[0]))  # noqa: E731
        packed = kernels.pack(pad(qw.codes), pad(qw.scales), pad(qw.mins), bits)
        layers.append((packed, qw.group_size, qw.out_features, qw.codes.shape[1]))
    x = inputs(weights)

    def run():
        return [torch.ops.genfast.qlinear(x[k], p, bits, g, n) for p, g, n, k in layers]

    return run, sum(layer[0].nbytes for layer in layers)


def aten_int4(weights: list[torch.Tensor], group_size: int) -> Variant:
    layers = []
    for w in weights:
        n, k = w.shape
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales_zeros = torch.randn(k // group_size, n, 2, dtype=torch.bfloat16)
        layers.append((packed, scales_zeros, k))
    x = inputs(weights)

    def run():
        return [torch.ops.aten._weight_int4pack_mm_for_cpu(x[k], p, group_size, sz) for p, sz, k in layers]

    return run, sum(p.nbytes + sz.nbytes for p, sz, _ in layers)


def aten_int8(weights: list[torch.Tensor]) -> Variant:
    layers = [
        (torch.randint(-127, 128, w.shape, dtype=torch.int8), torch.rand(w.shape[0], dtype=torch.bfloat16))
        for w in weights
    ]
    x = inputs(weights)

    def run():
        return [torch._weight_int8pack_mm(x[q.shape[1]], q, s) for q, s in layers]

    return run, sum(q.nbytes + s.nbytes for q, s in layers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--hot", action="store_true", help="the step's first matrix only, called HOT_CALLS times")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="the model whose step is run")
    parser.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = decode_step_shapes(args.shape)
    weights = [torch.randn(n, k) * 0.02 for n, k in (shapes[:1] if args.hot else shapes)]
    calls = HOT_CALLS if args.hot else 1
    builders = {
        "bf16 F.linear": lambda: bf16_linear(weights),
        "torch._weight_int8pack_mm (bf16 in)": lambda: aten_int8(weights),
        "aten int4pack_mm_for_cpu g32": lambda: aten_int4(weights, 32),
        "aten int4pack_mm_for_cpu g64": lambda: aten_int4(weights, 64),
    }
    reason = kernels.unavailable_reason()
    if reason is None:
        builders.update(
            {
                "genfast native int8": lambda: native(weights, 8, None),
                "genfast native int4 g32": lambda: native(weights, 4, 32),
                "genfast native int4 g64": lambda: native(weights, 4, 64),
            }
        )
    wanted = args.only.split(",") if args.only else list(builders)
    if unknown := set(wanted) - set(builders):
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {list(builders)}")
    variants = {name: builders[name]() for name in wanted}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (run, _) in variants.items():
                start = time.perf_counter()
                for _ in range(calls):
                    run()
                times[name].append((time.perf_counter() - start) / calls)
    print(f"{device_name(torch.device('cpu'))}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    if reason:
        print(f"native kernel not measured: {reason}")
    print(f"| kernel | ms per {'call' if args.hot else 'pass'} | MB read | GB/s |\n|---|---|---|---|")
    for name, (_, nbytes) in variants.items():
        median = statistics.median(times[name][2:])  # the first rounds warm up
        print(f"| {name} | {median * 1e3:.3g} | {nbytes / 1e6:.3g} | {nbytes / median / 1e9:.1f} |")


if __name__ == "__main__":
    main()
