"""The matrix-vector products of LLM decode on a CUDA GPU: which way of running one block's linears
(Llama-2-7B and Llama-3.1-8B shapes: fused qkv, o, fused gate/up, down) streams the weights
fastest, per weight format and batch size.

    python benchmarks/cuda_linear.py [--rows 1,8] [--shapes llama-2-7b,llama-3.1-8b] [--sweep]
                                     [--sweep-rows 1] [--variants "bf16 F.linear,int4 g32 triton"]

Variants per format, each compiled with the decode step's inductor options:
- bf16: F.linear (cuBLAS) and row_linear (inductor's fused multiply-sum);
- int8 (per-channel): genfast's Triton kernel (QuantLinear's "triton"), row_linear over the int8
  codes (gpt-fast's form), `_weight_int8pack_mm`, and F.linear over the codes upcast in the graph;
- int4 in groups of 32 and 128: genfast's Triton kernel (and, for one row, the same with the
  minima's part from x's sums: "x-sums"), tinygemm (`_weight_int4pack_mm`) with 2, 4 and 8 inner
  k-tiles, tinygemm's layout dequantized in the graph into cuBLAS (QuantLinear's path for more
  than `tinygemm.MAX_ROWS` rows: `--rows 8,16,32,64,128` finds where it overtakes tinygemm), and
  row_linear over codes dequantized in the graph ("dequantize").
`--sweep` first times the Triton kernels' block sizes (in the Triton formats that `--variants`
names, or all three), with K split into slices among them: for one row per linear shape, for more
rows on the same blocks, the tables genfast/kernels/triton/qlinear.py's defaults come from. A
block's weights (400+ MB) exceed the L2 cache, so each call reads them from memory. Every time is a
CUDA graph's replay, as decode runs (a compiled block launched from Python measured the host's
launches too: 12 or more for the Triton kernels' four linears). Median of CUDA-event timings; GB/s
counts the weight bytes only (codes and scales).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from genfast.compilation.inductor import inductor_options
from genfast.nn import row_linear
from genfast.quant import tinygemm
from genfast.quant.grids import QuantizedWeight, pack_nibbles, quantize, unpack_nibbles
from genfast.quant.linear import QuantLinear

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


def stored_bytes(qweights: list[QuantizedWeight]) -> int:
    """Bytes of the storage form, what genfast's kernels read: codes (int4 two per byte) and the
    fp16 scales and minima."""
    return sum(q.codes.numel() * q.bits // 8 + q.scales.nbytes + q.mins.nbytes for q in qweights)


def variants(shapes: list[tuple[int, int]]) -> dict[str, tuple[callable, int, bool]]:
    """name -> (block function of the inputs, weight bytes read, whether it takes more than one row)."""
    torch.manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in shapes]
    bf16_bytes = sum(w.numel() * 2 for w in weights)
    int8_weights = [quantize(w, 8) for w in weights]
    int8 = [QuantLinear(q, kernel="int8pack") for q in int8_weights]
    int8_bytes = sum(q.weight_int8.numel() + q.channel_scales.numel() * 2 for q in int8)

    def block(linear):
        return lambda xs: [linear(i, x) for i, x in enumerate(xs)]

    int8_triton = [QuantLinear(q, kernel="triton") for q in int8_weights]
    out = {
        "bf16 F.linear": (block(lambda i, x: F.linear(x, weights[i])), bf16_bytes, True),
        "int8 triton": (block(lambda i, x: int8_triton[i](x)), stored_bytes(int8_weights), True),
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
        triton_layers = [QuantLinear(q, kernel="triton") for q in qweights]
        out[f"int4 g{group} triton"] = (
            block(lambda i, x, layers=triton_layers: layers[i](x)),
            stored_bytes(qweights),
            True,
        )
        out[f"int4 g{group} triton x-sums"] = (
            block(lambda i, x, layers=triton_layers: x_sums_gemv(layers[i], x)),
            stored_bytes(qweights),
            False,
        )
        for tiles in (2, 4, 8):
            packed = [(tinygemm.pack(q.codes, tiles), tinygemm.scales_and_zeros(q.scales, q.mins)) for q in qweights]
            nbytes = sum(p.numel() * p.element_size() + sz.numel() * 2 for p, sz in packed)
            out[f"int4 g{group} tinygemm k-tiles {tiles}"] = (
                block(lambda i, x, packed=packed, g=group: torch.ops.aten._weight_int4pack_mm(x, *packed[i][:1], g,
                                                                                              packed[i][1])),
                nbytes,
                True,
            )  # fmt: skip
        # tinygemm's layout dequantized in the graph, then cuBLAS: what QuantLinear runs for more
        # than tinygemm.MAX_ROWS rows (prefill), against tinygemm itself at those rows
        int4pack_layers = [QuantLinear(q, kernel="int4pack") for q in qweights]
        out[f"int4 g{group} tinygemm dequantize+F.linear"] = (
            block(lambda i, x, layers=int4pack_layers: F.linear(x, layers[i].dequantize(x.dtype))),
            stored_bytes(qweights),
            True,
        )
        stored = [(pack_nibbles(q.codes), q.scales, q.mins) for q in qweights]
        nbytes = stored_bytes(qweights)

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


def compiled_variants(shape: str, wanted: list[str] | None, rows_wanted: list[int]) -> Iterator:
    """The variants of one `shape` block that `wanted` names (None: all), each compiled afresh (they
    share the block's code), with inputs for each of `rows_wanted` it takes: (name, weight bytes,
    rows, compiled block, inputs)."""
    table = variants(SHAPES[shape])
    if unknown := [name for name in wanted or () if name not in table]:
        raise SystemExit(f"unknown variants {unknown}; the variants: {', '.join(table)}")
    for name, (fn, nbytes, many_rows) in table.items():
        if wanted and name not in wanted:
            continue
        torch._dynamo.reset()
        run = compiled(fn)
        for rows in (r for r in rows_wanted if r == 1 or many_rows):
            xs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES[shape]]
            yield name, nbytes, rows, run, xs


def x_sums_gemv(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The one-row Triton kernel with its minima's part in the loop, from x's sums per 32 columns
    (X_SUMS, a candidate default), at the default block sizes."""
    from genfast.kernels.triton.qlinear import gemv_config, qlinear

    config = {**gemv_config(layer.out_features, layer.padded_in_features, layer.bits), "X_SUMS": 1}
    return qlinear(x, layer.codes, layer.scales, layer.mins, layer.bits, layer.group_size, config)


@torch.library.custom_op("cuda_linear::int8pack_mm", mutates_args=())
def int8pack_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """aten's op, kept opaque: inductor (2.11) cannot lower it on CUDA."""
    return torch.ops.aten._weight_int8pack_mm(x, weight, scales.to(x.dtype))


@int8pack_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def graph_ms(fn, xs: list[torch.Tensor]) -> float:
    """Median time of `fn(xs)` replayed from a CUDA graph (launch gaps out)."""
    fn(xs)  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(xs)
    return median_ms(lambda _: graph.replay(), xs)


# The formats the sweeps time the Triton kernels in: (variant name, bits, group size).
TRITON_FORMATS = [("int8 triton", 8, None), ("int4 g32 triton", 4, 32), ("int4 g128 triton", 4, 128)]
# The one-row kernel's block sizes timed per linear shape: (BLOCK_N, UNROLL, SUB, num_warps), each
# with K split 1, 2 and 4 ways. Chosen by what benchmarks/triton_sass.py counts: rows per thread
# (a thread loads x once for all of them; 4-8 rows load 1.5-2.1 bytes per byte of codes), no spills.
ONE_ROW_BLOCKS = [
    (16, 1, 512, 4), (16, 2, 512, 4), (8, 1, 1024, 2), (16, 1, 1024, 4), (32, 1, 256, 4), (64, 1, 256, 4),
    (16, 2, 1024, 2), (16, 2, 1024, 4), (32, 1, 1024, 4), (64, 2, 256, 2), (32, 2, 256, 1), (32, 2, 512, 4),
]  # fmt: skip
ONE_ROW_SPLITS = (1, 2, 4)
# The few-row kernel's (BLOCK_N, SUB, num_warps), each with K split 1, 2 and 4 ways: the int8 best
# of the 8-row sweep (32, 128, 4) and int4's fewest instructions per byte of codes without spills
# at 8-64 rows (`benchmarks/triton_sass.py --kernel few-row --configs sweep`).
FEW_ROW_BLOCKS = [
    (32, 128, 4), (16, 256, 2), (32, 128, 2), (32, 256, 2), (32, 256, 4), (64, 128, 2), (64, 128, 4),
    (64, 256, 4), (128, 128, 4),
]  # fmt: skip
ABOVE_L2_BYTES = 512 * 2**20  # each timed call reads another copy of the weight: no L2 hits


def sweep_one_row(
    shapes: list[tuple[int, int]],
    formats: list[tuple[int, int | None]],
    blocks: list[tuple[int, ...]] | None = None,
    splits: tuple[int, ...] = ONE_ROW_SPLITS,
) -> None:
    """The one-row kernel's block sizes (SPLIT_K among them: each of `splits`) per linear shape
    and format, each call of a CUDA graph reading another copy of the weight (one matrix fits an
    H200's 60 MB L2): the best three, the best that does not split K and the default
    (gemv_config's); every one of `blocks` where given (default ONE_ROW_BLOCKS)."""
    from itertools import product

    from genfast.kernels.triton.qlinear import gemv_config, qlinear, store_codes

    print("| out x in | format | block sizes | us per call | weight GB/s | vs bf16 (cuBLAS) |")
    print("|---|---|---|---|---|---|")
    for n, k in shapes:
        torch.manual_seed(0)
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        copies = -(-ABOVE_L2_BYTES // weight.nbytes)
        bf16 = [weight.clone() for _ in range(copies)]
        xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        bf16_us = 1000 * graph_ms(lambda xs: [F.linear(x, w) for x, w in zip(xs, bf16)], xs) / copies
        print(f"| {n} x {k} | bf16 (cuBLAS) | | {bf16_us:.1f} | {weight.nbytes / bf16_us / 1e3:.0f} | 1 |")
        for bits, group in formats:
            q = quantize(weight, bits, group)
            codes = store_codes(q.codes, bits)
            stored = [(codes.clone(), q.scales.clone(), q.mins.clone()) for _ in range(copies)]
            nbytes = stored_bytes([q])
            label = f"int{bits} {f'g{group}' if group else 'per channel'}"
            default = {"SPLIT_K": 1, **gemv_config(n, k, bits)}
            configs = [
                dict(BLOCK_N=block[0], UNROLL=block[1], SUB=block[2], num_warps=block[3], SPLIT_K=split)
                | ({"X_SUMS": block[4]} if len(block) > 4 else {})
                for block, split in product(blocks or ONE_ROW_BLOCKS, splits)
            ]
            timed = []
            for config in [default, *(c for c in configs if c != default)]:
                fn = lambda xs, config=config: [  # noqa: E731
                    qlinear(x, c, s, m, bits, q.group_size, config) for x, (c, s, m) in zip(xs, stored)
                ]
                try:
                    timed.append((1000 * graph_ms(fn, xs) / copies, config))
                except Exception as e:  # a configuration Triton cannot build here (registers, shared memory)
                    print(f"| {n} x {k} | {label} | {config} | failed: {type(e).__name__} | | |")
            shown = timed if blocks else timed[:1]  # the default first
            ranked = sorted(timed, key=lambda t: t[0])
            unsplit = [t for t in ranked if t[1]["SPLIT_K"] == 1][:1]
            for us, config in shown + [t for t in ranked[:3] + unsplit if t not in shown]:
                name = "default " if config is default else ""
                print(f"| {n} x {k} | {label} | {name}{config} | {us:.1f} | {nbytes / us / 1e3:.0f} "
                      f"| {bf16_us / us:.2f}x |")  # fmt: skip
        torch.cuda.empty_cache()


def sweep(shape: str, rows: int, formats: list[tuple[int, int | None]]) -> None:
    """The Triton kernels' block sizes, one block's linears per format, best first."""
    from itertools import product

    from genfast.kernels.triton.qlinear import gemm_config, qlinear, store_codes

    torch.manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in SHAPES[shape]]
    xs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES[shape]]
    if rows == 1:
        keys = ("BLOCK_N", "UNROLL", "SUB", "num_warps")
        configs = list(product((4, 8, 16), (1, 2, 4), (128, 256, 512), (4, 8)))
    else:
        keys = ("BLOCK_M", "BLOCK_N", "SUB", "num_warps", "SPLIT_K")
        block_m = gemm_config(rows, 4096, 4096, 8)["BLOCK_M"]
        configs = [(block_m, *blocks, split) for blocks in FEW_ROW_BLOCKS for split in (1, 2, 4)]
    bf16 = graph_ms(lambda xs: [F.linear(x, w) for x, w in zip(xs, weights)], xs)
    nbytes = sum(w.numel() * 2 for w in weights)
    print(f"| {shape} | bf16 (cuBLAS) | {rows} | | {bf16:.3f} | {nbytes / bf16 / 1e6:.0f} |")
    for bits, group in formats:
        qweights = [quantize(w, bits, group) for w in weights]
        stored = [(store_codes(q.codes, bits), q.scales, q.mins, q.group_size) for q in qweights]
        nbytes = stored_bytes(qweights)
        label = f"int{bits} {f'g{group}' if group else 'per channel'}"
        timed = []
        for values in configs:
            config = dict(zip(keys, values, strict=True))
            fn = lambda xs, config=config: [qlinear(x, c, s, m, bits, g, config) for x, (c, s, m, g) in zip(xs, stored)]  # noqa: E731
            try:
                timed.append((graph_ms(fn, xs), config))
            except Exception as e:  # a configuration Triton cannot build here (registers, shared memory)
                print(f"| {shape} | {label} | {rows} | {config} | failed: {type(e).__name__} | |")
        for ms, config in sorted(timed, key=lambda t: t[0])[:5]:
            print(f"| {shape} | {label} | {rows} | {config} | {ms:.3f} | {nbytes / ms / 1e6:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="first time the Triton kernels' block sizes")
    parser.add_argument("--sweep-rows", help="the row counts the sweep times (default: --rows)")
    parser.add_argument("--variants", help="comma-separated variant names to time (default: all)")
    parser.add_argument(
        "--one-row-blocks",
        help='the one-row sweep\'s block sizes, "BLOCK_N,UNROLL,SUB,num_warps[,X_SUMS];...", each with K split as '
        "--one-row-splits says, every one printed (default: ONE_ROW_BLOCKS, the best printed)",
    )
    parser.add_argument(
        "--one-row-splits",
        default=",".join(map(str, ONE_ROW_SPLITS)),
        help="the slices K is cut into for each of the one-row sweep's block sizes (a slice is whole "
        "sub-blocks, so a 1024-column SUB cuts K=4096 at most 4 ways)",
    )
    args = parser.parse_args()
    blocks = (
        [tuple(int(v) for v in b.split(",")) for b in args.one_row_blocks.split(";")] if args.one_row_blocks else None
    )
    if blocks and any(len(b) not in (4, 5) for b in blocks):
        raise SystemExit(f"--one-row-blocks wants BLOCK_N,UNROLL,SUB,num_warps[,X_SUMS] each: {args.one_row_blocks}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    if args.sweep:
        # the Triton formats that --variants names (all three without it)
        formats = [
            (bits, group)
            for name, bits, group in TRITON_FORMATS
            if not args.variants or name in args.variants.split(",")
        ]
        rows_wanted = [int(r) for r in (args.sweep_rows or args.rows).split(",")]
        if 1 in rows_wanted:
            linears = dict.fromkeys(nk for shape in args.shapes.split(",") for nk in SHAPES[shape])
            sweep_one_row(list(linears), formats, blocks, tuple(int(v) for v in args.one_row_splits.split(",")))
            print()
        if any(rows > 1 for rows in rows_wanted):
            print("| shapes | format | rows | Triton block sizes | ms per block (CUDA graph) | weight GB/s |")
            print("|---|---|---|---|---|---|")
            for shape in args.shapes.split(","):
                for rows in (r for r in rows_wanted if r > 1):
                    sweep(shape, rows, formats)
            print()
    print("| shapes | variant | rows | ms per block (CUDA graph) | weight GB/s |")
    print("|---|---|---|---|---|")
    wanted = args.variants.split(",") if args.variants else None
    for shape in args.shapes.split(","):
        for name, nbytes, rows, run, xs in compiled_variants(shape, wanted, [int(r) for r in args.rows.split(",")]):
            try:  # in a CUDA graph, as decode runs: the GPU's time, not the host's launches
                ms = graph_ms(run, xs)
            except Exception as e:  # a variant torch cannot run here: say so in the table
                print(f"| {shape} | {name} | {rows} | failed: {type(e).__name__}: {str(e)[:80]} | |")
                continue
            print(f"| {shape} | {name} | {rows} | {ms:.3f} | {nbytes / ms / 1e6:.0f} |")


if __name__ == "__main__":
    main()
