"""The fixed cost of one call of each native decode op, at shapes too small for the work to count.

python benchmarks/op_overhead.py [--threads 2]

A SmolLM2 decode step calls the few-row linear 121 times and decode attention 30 times (the
quantized linear instead of the few-row one under --quant), so a microsecond per call is
~0.15 ms a step. Each row: the op called from Python on one row of 64 columns (attention: 8
cached keys), median of 7 runs of 20,000 calls, in µs, beside an empty PyTorch op (`Tensor.view`,
dispatch only) for scale. Both input dtypes a decode step uses, because a conversion inside an op
is a dispatched op of its own.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from genfast.kernels import LINEAR_FEW_ROWS, QLINEAR
from genfast.llm.model import decode_attention
from genfast.nn import few_rows_kernel_available
from genfast.quant.linear import QuantLinear


def per_call_us(fn: Callable[[], object], calls: int = 20_000) -> float:
    for _ in range(500):
        fn()
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    few_rows_kernel_available()  # loads the op libraries
    ops = torch.ops.genfast
    rows: list[tuple[str, float]] = []
    x32 = torch.randn(1, 64)
    rows.append(("Tensor.view (dispatch only)", per_call_us(lambda: x32.view(64))))
    weight = torch.randn(64, 64).to(torch.bfloat16)
    linear = nn.Linear(64, 64, bias=False)
    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype)
        if LINEAR_FEW_ROWS.available():
            rows.append((f"linear_few_rows, {dtype} row", per_call_us(lambda x=x: ops.linear_few_rows(x, weight))))
        if QLINEAR.available():
            layer = QuantLinear.from_linear(linear, 8)
            fn = lambda x=x: ops.qlinear(x, layer.packed, 8, layer.group_size, 64)  # noqa: E731
            rows.append((f"qlinear int8, {dtype} row", per_call_us(fn)))
    if decode_attention.kernel_available():
        k = torch.randn(1, 3, 8, 64).to(torch.bfloat16)
        mask = torch.ones(1, 1, 1, 8, dtype=torch.bool)
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(1, 9, 1, 64).to(dtype)
            fn = lambda q=q: decode_attention.decode_attention(q, k, k, mask, 0.125)  # noqa: E731
            rows.append((f"decode_attention, {dtype} query, 8 keys", per_call_us(fn)))
    print(f"{args.threads} threads; µs per call, median of 7 runs of 20,000 calls")
    print("| op | µs per call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
