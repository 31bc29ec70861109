"""The matrix-vector products of LLM decode on a CUDA GPU: which way of running one block's linears
(Llama-2-7B and Llama-3.1-8B shapes: fused qkv, o, fused gate/up, down) streams the weights
fastest, per weight format and batch size.

    python benchmarks/cuda_linear.py [--rows 1,8]

Variants per format, each compiled with the decode step's inductor options:
- bf16: F.linear (cuBLAS) and row_linear (inductor's fused multiply-sum);
- int8 (per-channel): row_linear over the int8 codes (gpt-fast's form), `_weight_int8pack_mm`, and
  F.linear over the codes upcast in the graph;
- int4 in groups of 32 and 128: tinygemm (`_weight_int4pack_mm`) with 2, 4 and 8 inner k-tiles,
  and row_linear over codes dequantized in the graph (QuantLinear's "dequantize" kernel).
A block's weights (400+ MB) exceed the L2 cache, so each call reads them from memory. Median of
CUDA-event timings; GB/s counts the weight bytes only (codes and scales).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from genfast.compile import inductor_options
from genfast.nn import row_linear
from genfast.quant.grids import QuantizedWeight, pack_nibbles, quantize, unpack_nibbles
from genfast.quant.linear import QuantLinear, int4pack, int4pack_scales_and_zeros

SHAPES = {  # (out, in) of one block's linears
    "llama-2-7b": [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)],
    "llama-3.1-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}


def median_ms(fn, x: list[torch.Tensor], repeats: int = 50) -> float:
    for _ in range(5):
        fn(x)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def compiled(fn):
    return torch.compile(fn, fullgraph=True, dynamic=False, options=inductor_options("cuda", decode=False))


def variants(shapes: list[tuple[int, int]]) -> dict[str, tuple[callable, int, bool]]:
    """name -> (block function of the inputs, weight bytes read, whether it takes more than one row)."""
    torch.manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in shapes]
    bf16_bytes = sum(w.numel() * 2 for w in weights)
    int8 = [QuantLinear(quantize(w, 8)) for w in weights]
    int8_bytes = sum(q.weight_int8.numel() + q.channel_scales.numel() * 2 for q in int8)

    def block(linear):
        return lambda xs: [linear(i, x) for i, x in enumerate(xs)]

    out = {
        "bf16 F.linear": (block(lambda i, x: F.linear(x, weights[i])), bf16_bytes, True),
        "bf16 row_linear": (block(lambda i, x: row_linear(x, weights[i])), bf16_bytes, False),
        "int8 row_linear": (
            block(lambda i, x: row_linear(x, int8[i].weight_int8, scales=int8[i].channel_scales)),
            int8_bytes,
            False,
        ),
        "int8 F.linear(upcast)": (
            block(lambda i, x: F.linear(x, int8[i].weight_int8.to(x.dtype)) * int8[i].channel_scales),
            int8_bytes,
            True,
        ),
    }
    out["int8 _weight_int8pack_mm"] = (
        block(lambda i, x: int8pack_mm(x, int8[i].weight_int8, int8[i].channel_scales)),
        int8_bytes,
        True,
    )
    for group in (32, 128):
        qweights = [quantize(w, 4, group) for w in weights]
        for tiles in (2, 4, 8):
            packed = [(int4pack(q.codes, tiles), int4pack_scales_and_zeros(q)) for q in qweights]
            nbytes = sum(p.numel() * p.element_size() + sz.numel() * 2 for p, sz in packed)
            out[f"int4 g{group} tinygemm k-tiles {tiles}"] = (
                block(lambda i, x, packed=packed, g=group: torch.ops.aten._weight_int4pack_mm(x, *packed[i][:1], g,
                                                                                              packed[i][1])),
                nbytes,
                True,
            )  # fmt: skip
        stored = [(pack_nibbles(q.codes), q.scales, q.mins) for q in qweights]
        nbytes = sum(c.numel() + s.numel() * 2 + m.numel() * 2 for c, s, m in stored)

        def dequantized(i: int, dtype: torch.dtype, stored=stored, group=group) -> torch.Tensor:
            packed_codes, scales, mins = stored[i]  # in the graph: nibbles unpacked and scaled in one pass
            k = packed_codes.shape[1] * 2
            return QuantizedWeight(unpack_nibbles(packed_codes), scales, mins, 4, group, k).dequantize(dtype)

        out[f"int4 g{group} dequantize+row_linear"] = (
            block(lambda i, x, dequantized=dequantized: row_linear(x, dequantized(i, x.dtype))),
            nbytes,
            False,
        )
    return out


@torch.library.custom_op("cuda_linear::int8pack_mm", mutates_args=())
def int8pack_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """aten's op, kept opaque: inductor (2.11) cannot lower it on CUDA."""
    return torch.ops.aten._weight_int8pack_mm(x, weight, scales.to(x.dtype))


@int8pack_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| shapes | variant | rows | ms per block | weight GB/s |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        for name, (fn, nbytes, many_rows) in variants(SHAPES[shape]).items():
            torch._dynamo.reset()  # each variant compiles afresh (they share the block's code)
            run = compiled(fn)
            for rows in (int(r) for r in args.rows.split(",")):
                if rows > 1 and not many_rows:
                    continue
                xs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES[shape]]
                try:
                    ms = median_ms(run, xs)
                except Exception as e:  # a variant torch cannot run here: say so in the table
                    print(f"| {shape} | {name} | {rows} | failed: {type(e).__name__}: {str(e)[:80]} | |")
                    continue
                print(f"| {shape} | {name} | {rows} | {ms:.3f} | {nbytes / ms / 1e6:.0f} |")


if __name__ == "__main__":
    main()
