"""One-row (batch-1 decode) linear layers on this machine: which formulation streams weights fastest.

Runs the weight matrices of one decode step (per block: fused qkv, o, gate+up, down; plus the
output head) with random bf16 weights, and prints GB/s of weight read. The default shape is
SmolLM2-135M's (121 matrices, 30 blocks, a 49152 x 576 head); `--shape` takes any of genfast's
`random:` shapes (llama-3.2-1b: 65 matrices, 2.5 GB):

    python benchmarks/linear_kernels.py                  # one row
    python benchmarks/linear_kernels.py --rows 2,3,5,8   # a few rows: batched decode, verification
    python benchmarks/linear_kernels.py --prefill 6,64,512   # fp32 rows over bf16 weights (AVX2's auto)

The results decided genfast.nn.Linear's compiled paths, the few-row kernel's MAX_FEW_ROWS and the widening GEMM
(docs/notes.md).
"""

import argparse
import time

import torch
import torch.nn.functional as F

from genfast.bench.machine import device_name, measure_read_bandwidth
from genfast.bench.timing import median_seconds
from genfast.kernels.linear_few_rows import ops as few_rows_kernel
from genfast.kernels.linear_widening_gemm import ops as widening_kernel
from genfast.llm.checkpoints.random_model import SHAPES, decode_step_shapes
from genfast.nn import row_linear


def best_of(fn, repeats: int = 15) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def few_rows(counts: list[int], shapes: list[tuple[int, int]]) -> None:
    """Each formulation compiled over the whole step, per row count."""
    reason = few_rows_kernel.unavailable_reason()
    if reason:
        raise SystemExit(f"the few-row kernel cannot run here: {reason}")
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 4 * len(counts)
    weights = [torch.randn(n, k).bfloat16() for n, k in shapes]
    total = sum(w.nbytes for w in weights)
    dim, ffn = shapes[0][1], shapes[3][1]

    def step(linear, x_dim, x_ffn):
        return [linear(x_dim if w.shape[1] == dim else x_ffn, w) for w in weights]

    formulations = {
        "compiled F.linear (aten)": torch.compile(lambda a, b: step(F.linear, a, b), dynamic=False),
        "compiled few-row kernel": torch.compile(lambda a, b: step(few_rows_kernel.linear, a, b), dynamic=False),
        "compiled one-row reduction, row by row": torch.compile(
            lambda a, b: [step(row_linear, a[i : i + 1], b[i : i + 1]) for i in range(a.shape[0])], dynamic=False
        ),
    }
    print(f"{device_name('cpu')}, torch {torch.__version__}; {total / 1e6:.0f} MB of bf16 weights per step\n")
    print(
        "| rows | "
        + " | ".join(f"{name} ms (GB/s)" for name in formulations)
        + " |\n|---|"
        + "---|" * len(formulations)
    )
    for rows in counts:
        x_dim, x_ffn = torch.randn(rows, dim).bfloat16(), torch.randn(rows, ffn).bfloat16()
        cells = []
        for fn in formulations.values():
            with torch.inference_mode():
                t = best_of(lambda: fn(x_dim, x_ffn), repeats=10)
            cells.append(f"{t * 1e3:.2f} ({total / t / 1e9:.0f})")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


def prefill(counts: list[int], shapes: list[tuple[int, int]]) -> None:
    """fp32 rows times one block's bf16 weights (the first four matrices of the step), eagerly,
    as `--dtype auto` runs a prefill on a CPU without native bf16: the widening GEMM against the
    weight upcast for aten's GEMM (the path before it) and aten on a weight kept in fp32. Median
    of 7 calls per matrix, GFLOP/s over the four."""
    reason = widening_kernel.KERNEL.unavailable_reason()
    if reason:
        raise SystemExit(f"the widening GEMM cannot run here: {reason}")
    torch.manual_seed(0)
    weights = [torch.randn(n, k).bfloat16() for n, k in shapes[:4]]
    fp32_weights = [w.float() for w in weights]
    ways = {
        "widening GEMM": lambda x, i: widening_kernel.linear(x, weights[i]),
        "upcast + aten": lambda x, i: F.linear(x, weights[i].float()),
        "aten, fp32 weight": lambda x, i: F.linear(x, fp32_weights[i]),
    }
    print(f"{device_name('cpu')}, torch {torch.__version__}; one block's "
          f"matrices {', '.join(f'{n}x{k}' for n, k in shapes[:4])}\n")  # fmt: skip
    print("| rows | " + " | ".join(f"{name} GFLOP/s" for name in ways) + " |\n|---|" + "---|" * len(ways))
    for rows in counts:
        cells = []
        for way in ways.values():
            seconds = 0.0
            for i, w in enumerate(weights):
                x = torch.randn(rows, w.shape[1])
                seconds += median_seconds(lambda x=x, i=i: way(x, i), 7)
            flops = sum(2 * rows * w.numel() for w in weights)
            cells.append(f"{flops / seconds / 1e9:.0f}")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


def main(shapes: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    weights = [torch.randn(n, k).bfloat16() for n, k in shapes]
    total = sum(w.nbytes for w in weights)
    dim, ffn = shapes[0][1], shapes[3][1]
    x = {k: torch.randn(1, k).bfloat16() for k in (dim, ffn)}

    def eager_linear():
        return [F.linear(x[w.shape[1]], w) for w in weights]

    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]

    def onednn_packed():
        return [
            torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, packed)
        ]

    def step_linear(x_dim, x_ffn):
        return [F.linear(x_dim if w.shape[1] == dim else x_ffn, w) for w in weights]

    def step_reduction(x_dim, x_ffn):
        return [row_linear(x_dim if w.shape[1] == dim else x_ffn, w) for w in weights]

    def dependent_chain(x_dim):
        # As in the model: each matmul's input is the previous one's output.
        h = x_dim
        for i in range(0, len(weights) - 1, 4):
            a = row_linear(h, weights[i])[..., :dim]
            b = row_linear(a, weights[i + 1])
            c = row_linear(b, weights[i + 2])[..., :ffn]
            h = h + row_linear(c, weights[i + 3])
        return row_linear(h, weights[-1])

    compiled_chain = torch.compile(dependent_chain, dynamic=False)
    compiled_linear = torch.compile(step_linear, dynamic=False)
    compiled_reduction = torch.compile(step_reduction, dynamic=False)
    rows = [
        ("eager F.linear (aten::mm)", eager_linear),
        ("eager oneDNN, pre-packed weights", onednn_packed),
        ("compiled F.linear (one graph)", lambda: compiled_linear(x[dim], x[ffn])),
        ("compiled multiply-sum reduction (one graph)", lambda: compiled_reduction(x[dim], x[ffn])),
        ("compiled multiply-sum reduction, dependent chain", lambda: compiled_chain(x[dim])),
    ]
    peak = measure_read_bandwidth("cpu")
    print(
        f"{device_name('cpu')}, torch {torch.__version__}; {total / 1e6:.0f} MB of bf16 weights per step; "
        f"measured read bandwidth {peak / 1e9:.1f} GB/s\n"
    )
    print("| formulation | ms / step | GB/s |\n|---|---|---|")
    for name, fn in rows:
        with torch.inference_mode():
            t = best_of(fn)
        print(f"| {name} | {t * 1e3:.2f} | {total / t / 1e9:.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", help="comma-separated row counts: time the few-row formulations instead")
    parser.add_argument("--prefill", help="comma-separated row counts: time the fp32-rows-over-bf16 GEMMs instead")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="the model whose step is run")
    args = parser.parse_args()
    if args.prefill:
        prefill([int(r) for r in args.prefill.split(",")], decode_step_shapes(args.shape))
    elif args.rows:
        few_rows([int(r) for r in args.rows.split(",")], decode_step_shapes(args.shape))
    else:
        main(decode_step_shapes(args.shape))
