"""genfast's Triton int8/int4 linears (genfast/kernels/qlinear_triton.py) run by Triton's
interpreter on the CPU: their indexing, masks, nibble order, groups and remainders are checked in
CI, where no GPU is; tests/cuda runs the same kernels compiled, on a GPU. The interpreter computes
a bf16 `tl.dot` wrongly (~1e11 where the GPU is right), so the few-row kernel is checked here in
fp32 and fp16, and in bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from genfast.quant.grids import quantize  # noqa: E402
from genfast.quant.linear import QuantLinear  # noqa: E402

if not triton.knobs.runtime.interpret:
    pytest.skip("Triton's interpreter is off (a GPU is here: tests/cuda runs these kernels)", allow_module_level=True)

from genfast.kernels import qlinear_triton  # noqa: E402

FORMATS = [(8, None), (8, 64), (4, 32), (4, 64), (4, 128)]  # (bits, group size; None: per channel)


def layer(bits: int, group: int | None, n: int = 37, k: int = 512, bias: bool = False) -> QuantLinear:
    """37 output rows: not a whole number of any block; k = 384 leaves a remainder after the
    unrolled loop."""
    torch.manual_seed(bits * 1000 + (group or 0) + k)
    weight = torch.randn(n, k) * 0.05
    return QuantLinear(quantize(weight, bits, group), torch.randn(n) if bias else None, kernel="triton")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def run(lin: QuantLinear, x: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    return qlinear_triton.qlinear(x, lin.codes, lin.scales, lin.mins, lin.bits, lin.group_size, config)


@pytest.mark.parametrize("k", [512, 384])
@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_one_row_kernel_matches_the_dequantized_weight(bits, group, k, dtype, tolerance):
    lin = layer(bits, group, k=k)
    x = torch.randn(1, k).to(dtype)
    got = run(lin, x)
    assert got.dtype == dtype and got.shape == (1, 37)
    assert relative_error(got, F.linear(x.double(), lin.dequantize(torch.float64))) < tolerance


@pytest.mark.parametrize("rows", [2, 5, 17, 64])
@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_few_row_kernel_matches_the_dequantized_weight(bits, group, rows, dtype, tolerance):
    lin = layer(bits, group)
    x = torch.randn(rows, 512).to(dtype)
    got = run(lin, x)
    assert got.dtype == dtype and got.shape == (rows, 37)
    assert relative_error(got, F.linear(x.double(), lin.dequantize(torch.float64))) < tolerance


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_the_one_row_result_does_not_depend_on_the_other_block_sizes(bits, group, split_k):
    """Along K the summation order is the sub-block's and the split's, so in the interpreter (which
    sums a tile in one order whatever its layout) configurations that differ in their other sizes
    give the same bits: their row blocks, masks and unrolled remainders cover the same products. On
    a GPU the last sum over a tile's lanes follows its layout; tests/cuda checks eager against
    compiled instead."""
    lin = layer(bits, group)
    x = torch.randn(1, 512, dtype=torch.bfloat16)
    configs = [dict(BLOCK_N=n, UNROLL=u, SUB=128, SPLIT_K=split_k, num_warps=4) for n, u in ((4, 1), (8, 2), (16, 4))]
    outputs = [run(lin, x, config) for config in configs]
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


@pytest.mark.parametrize("k", [512, 384])
@pytest.mark.parametrize("split_k", [2, 3, 8])
@pytest.mark.parametrize("bits,group", [(8, None), (8, 64), (4, 32), (4, 128)])
def test_one_row_split_over_k_matches_the_dequantized_weight(bits, group, split_k, k):
    """K cut into slices (uneven, or fewer than asked where K has fewer sub-blocks), each summed
    by its own programs, the partial sums added after."""
    lin = layer(bits, group, k=k)
    x = torch.randn(1, k)
    got = run(lin, x, dict(BLOCK_N=8, UNROLL=2, SUB=128, SPLIT_K=split_k, num_warps=4))
    assert got.dtype == torch.float32 and got.shape == (1, 37)
    assert relative_error(got, F.linear(x.double(), lin.dequantize(torch.float64))) < 1e-6


def test_k_is_split_into_whole_sub_blocks():
    from genfast.kernels.qlinear_triton import k_splits

    assert k_splits(4096, 512, 1) == (1, 4096)
    assert k_splits(4096, 512, 4) == (4, 1024)
    assert k_splits(11008, 256, 4) == (4, 2816)  # 11 sub-blocks each
    assert k_splits(384, 128, 8) == (3, 128)  # no more slices than sub-blocks
    assert k_splits(640, 128, 2) == (2, 384)  # 5 sub-blocks: 3 + 2


@pytest.mark.parametrize("shape", [(1, 1, 512), (2, 3, 512)])
def test_quant_linear_runs_its_triton_kernel_with_bias_and_leading_dimensions(shape):
    lin = layer(4, 32, bias=True)
    x = torch.randn(shape)
    want = F.linear(x.double(), lin.dequantize(torch.float64), lin.bias.double())
    got = lin(x)
    assert got.shape == (*shape[:-1], 37)
    assert relative_error(got, want) < 1e-6


COUNT_LOOP = """
import json, sys
sys.path.insert(0, "benchmarks")
import triton_sass
from genfast.kernels.qlinear_triton import gemv_config
count = triton_sass.compile_gemv(8, None, gemv_config(4096, 4096, 8), 90)
print(json.dumps({"per_byte": count.instructions / triton_sass.bytes_per_pass(8, gemv_config(4096, 4096, 8)),
                  "opcodes": sorted(count.by_opcode), "stack": count.stack_bytes}))
"""


def test_the_int8_one_row_loop_compiles_for_sm90_to_few_instructions_per_byte():
    """Decode's int8 product is bound by instruction issue on an H100 (docs/performance.md): the
    per-row kernel's loop, compiled for sm_90 by Triton's own ptxas (no GPU needed; the
    interpreter off in that process), stays under 6 instructions per byte of codes (4.9 with
    Triton 3.6 and 3.9; the kernel before took 11.4-18.8), without a layout conversion (shared
    memory, barriers) or spills inside the loop."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", COUNT_LOOP], cwd=root, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    count = json.loads(out.stdout.splitlines()[-1])
    assert count["per_byte"] < 6, count
    assert not [op for op in count["opcodes"] if op.startswith(("LDS", "STS", "BAR"))], count
    assert count["stack"] == 0
