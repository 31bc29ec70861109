"""The native MXFP4 expert kernel (the variant this CPU runs; `scripts/with_isa.sh avx2` runs the
AVX2 one) against the same product computed in float64 from the dequantized weights."""

import pytest
import torch

from genfast.kernels.mxfp4_linear import ops as kernel
from genfast.quant.mxfp4 import MXFP4ExpertLinear

pytestmark = pytest.mark.skipif(
    not kernel.available(), reason=f"native kernel unavailable: {kernel.unavailable_reason()}"
)

# Against the exact product: the kernel quantizes activations to int8 per block of 32 (scale
# amax / 127, so each value moves by at most amax / 254, ~0.4% of the block's largest), so outputs
# stay within 2% relative (Frobenius) of the product of the unquantized rows.
REL_TOL = 2e-2


def random_layer(n_experts: int, n: int, k: int, seed: int = 0) -> MXFP4ExpertLinear:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n_experts, n, k // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 132, (n_experts, n, k // 32), dtype=torch.uint8, generator=g)
    return MXFP4ExpertLinear.from_hf(blocks, scales)


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """The rows as the kernel sees them: int8 per block of 32, scale amax / 127, half to even."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q * scale).reshape(x.shape).double()


def products(layer: MXFP4ExpertLinear, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact product of the quantized rows, bound on its fp32 rounding) per output, in float64."""
    w = layer.dequantize(torch.float64)[experts]
    xq = quantized_rows(x)
    exact = torch.einsum("rnk,rk->rn", w, xq)
    magnitude = torch.einsum("rnk,rk->rn", w.abs(), xq.abs())
    return exact, 1e-5 * magnitude + 1e-30


def check(layer: MXFP4ExpertLinear, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    got = layer(x, experts)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], layer.out_features)
    exact, bound = products(layer, x, experts)
    if x.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2**-8  # the output's own rounding
    assert ((got.double() - exact).abs() <= bound).all()
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 64), (40, 96), (200, 32), (90, 320)])
def test_matches_the_product_of_int8_rows(dtype, n, k):
    layer = random_layer(5, n, k)
    assert layer.native
    x = torch.randn(9, k).to(dtype)
    experts = torch.tensor([4, 0, 4, 1, 4, 0, 3, 1, 4])  # expert 2 unused
    check(layer, x, experts)


def test_one_row():
    layer = random_layer(4, 130, 128)
    check(layer, torch.randn(1, 128), torch.tensor([2]))


def test_many_rows_per_expert_in_any_order():
    layer = random_layer(3, 72, 64, seed=1)
    experts = torch.randint(0, 3, (150,), generator=torch.Generator().manual_seed(2))
    x = torch.randn(150, 64)
    got = check(layer, x, experts)
    one_by_one = torch.cat([layer(x[i : i + 1], experts[i : i + 1]) for i in range(150)])
    assert torch.equal(got, one_by_one)  # a row's result does not depend on the other rows


def test_zero_rows_and_zero_blocks():
    layer = random_layer(2, 32, 64)
    x = torch.randn(3, 64)
    x[1] = 0
    x[2, :32] = 0
    got = check(layer, x, torch.tensor([0, 1, 1]))
    assert not got[1].any()
    assert layer(torch.empty(0, 64), torch.empty(0, dtype=torch.long)).shape == (0, 32)


def test_denormal_and_large_scales():
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (1, 16, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.tensor([0, 1, 2, 127, 160, 140, 100, 130] * 4, dtype=torch.uint8).reshape(1, 16, 2)
    layer = MXFP4ExpertLinear.from_hf(blocks, scales)  # row 0's two blocks: 2^-127 and 2^-126
    x = torch.randn(2, 64)
    x[1] *= 1e25  # denormal weight scales times large activations: visible, not flushed
    got = check(layer, x, torch.tensor([0, 0]))
    assert got[1, 0].abs() > 1e-20


def test_within_budget_of_the_exact_product():
    layer = random_layer(4, 256, 512)
    x = torch.randn(4, 512)
    experts = torch.tensor([0, 1, 2, 3])
    want = torch.einsum("rnk,rk->rn", layer.dequantize(torch.float64)[experts], x.double())
    got = layer(x, experts)
    assert ((got.double() - want).norm() / want.norm()).item() < REL_TOL


def test_portable_path_agrees():
    layer = random_layer(3, 100, 96)
    x, experts = torch.randn(5, 96), torch.tensor([2, 0, 2, 1, 1])
    portable = torch.ops.genfast.mxfp4_expert_linear_dequantized(x, experts, layer.packed, 100)
    native = layer(x, experts)
    assert ((native - portable).norm() / portable.norm()).item() < REL_TOL


def test_errors_are_clear():
    layer = random_layer(2, 16, 64)
    with pytest.raises(RuntimeError, match="expert index out of range"):
        layer(torch.randn(1, 64), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.genfast.mxfp4_expert_linear(torch.randn(1, 48), torch.tensor([0]), layer.packed, 16)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.genfast.mxfp4_expert_linear(torch.randn(1, 96), torch.tensor([0]), layer.packed, 16)


def test_compiled_equals_eager():
    layer = random_layer(4, 48, 64)
    x, experts = torch.randn(3, 64), torch.tensor([1, 3, 1])

    def step(x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return layer(x * 2, experts) + 1

    compiled = torch.compile(step, fullgraph=True)
    assert torch.equal(compiled(x, experts), step(x, experts))
