"""GPTQ: same grid as round-to-nearest, lower layer output error than it (LLM calibration: tests/llm)."""

import pytest
import torch

from genfast.quant.gptq import HessianAccumulator, gptq_quantize
from genfast.quant.grids import group_grid, quantize, quantize_to_grid


def correlated_problem(n: int = 64, k: int = 256, rows: int = 2048, seed: int = 0):
    """(W [n, k], X [rows, k]) with inputs X = Z A correlated across columns, as activations are."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g) @ (torch.randn(k, k, generator=g) / k**0.5)
    return w, x


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    acc.add(x)
    return acc.hessian


def output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return (x @ w.T - x @ q.T).norm().item()


def naive_gptq_codes(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float = 0.01):
    """The paper's algorithm without its speed-ups (no Cholesky, no lazy blocks), in fp64: after
    each column, update the remaining weights with the full inverse Hessian, then remove that
    column from the inverse (Gaussian elimination)."""
    w = weight.double().clone()
    h = hessian.double().clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    hinv = torch.linalg.inv(h)
    codes = torch.zeros(weight.shape, dtype=torch.uint8)
    for q in range(weight.shape[1]):
        if q % group_size == 0:
            scale, minimum = group_grid(w[:, q : q + group_size].float(), 4, group_size)
        codes[:, q] = quantize_to_grid(w[:, q].float(), scale[:, 0], minimum[:, 0], 4)
        error = (w[:, q] - (codes[:, q].double() * scale[:, 0].double() + minimum[:, 0].double())) / hinv[q, q]
        w -= error[:, None] * hinv[q][None, :]
        hinv -= hinv[:, q : q + 1] @ hinv[q : q + 1, :] / hinv[q, q]
    return codes


def test_hessian_accumulator_is_twice_the_mean_outer_product():
    x = torch.randn(300, 24)
    acc = HessianAccumulator(24)
    acc.add(x[:100].reshape(4, 25, 24))  # any leading shape
    acc.add(x[100:].bfloat16())  # any dtype (accumulated in fp32)
    want = 2 * x.T @ x / 300
    torch.testing.assert_close(acc.hessian, want, atol=0.05, rtol=0.02)  # bf16 rows
    assert acc.count == 300
    with pytest.raises(ValueError, match="no inputs"):
        _ = HessianAccumulator(8).hessian


@pytest.mark.parametrize("group_size,block_size", [(32, 128), (64, 32), (128, 48)])
def test_matches_the_unoptimized_algorithm(group_size, block_size):
    """Lazy block updates and the Cholesky form change nothing but speed (any block/group sizes)."""
    w, x = correlated_problem(n=32, k=128, rows=1024, seed=1)
    h = hessian_of(x)
    got = gptq_quantize(w, h, 4, group_size, block_size).codes
    assert (got == naive_gptq_codes(w, h, group_size)).float().mean() >= 0.99


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_lower_output_error_than_round_to_nearest(group_size, act_order):
    """Measured ratio GPTQ / RTN of ||X W^T - X Q^T||: ~0.70 (0.69-0.72 over seeds and group sizes)."""
    w, x = correlated_problem()
    rtn = output_error(x, w, quantize(w, 4, group_size).dequantize())
    gptq = output_error(x, w, gptq_quantize(w, hessian_of(x), 4, group_size, act_order=act_order).dequantize())
    assert gptq < 0.8 * rtn


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("k,group_size", [(256, 128), (200, 64), (96, 32)])
def test_same_grid_and_layout_as_round_to_nearest(k, group_size, act_order):
    w, x = correlated_problem(n=48, k=k, rows=512)
    q = gptq_quantize(w.bfloat16(), hessian_of(x), 4, group_size, act_order=act_order)
    rtn = quantize(w, 4, group_size)
    for name in ("codes", "scales", "mins"):
        got, want = getattr(q, name), getattr(rtn, name)
        assert got.shape == want.shape and got.dtype == want.dtype, name
    assert (q.bits, q.group_size, q.in_features) == (4, group_size, k)
    assert q.codes.max() <= 15
    assert q.dequantize().shape == (48, k)
    # Every weight lies on its group's grid: the codes re-derive exactly from the stored grid.
    scales, mins = (t.repeat_interleave(group_size, dim=1) for t in (q.scales, q.mins))
    deq = q.codes.float() * scales.float() + mins.float()
    assert torch.equal(quantize_to_grid(deq, scales, mins, 4), q.codes)


@pytest.mark.parametrize("group_size", [32, 128])
def test_diagonal_hessian_gives_round_to_nearest(group_size):
    """Uncorrelated inputs leave no other column to take a column's error: GPTQ is RTN."""
    w = torch.randn(40, 256)
    h = torch.diag(torch.rand(256) + 0.1)
    q, rtn = gptq_quantize(w, h, 4, group_size), quantize(w, 4, group_size)
    assert (q.codes == rtn.codes).float().mean() >= 0.99
    torch.testing.assert_close(q.scales, rtn.scales)
    torch.testing.assert_close(q.mins, rtn.mins)


def test_dead_columns_are_zeroed_without_nans():
    w, x = correlated_problem(k=128, rows=1024)
    dead = torch.tensor([0, 5, 64, 127])
    x[:, dead] = 0
    q = gptq_quantize(w, hessian_of(x), 4, 32)
    deq = q.dequantize()
    assert deq.isfinite().all() and q.scales.float().isfinite().all()
    step = q.scales.float().repeat_interleave(32, dim=1)[:, dead]
    assert (deq[:, dead].abs() <= step / 2 + 1e-6).all()  # zero, up to the grid
    assert output_error(x, w, deq) < output_error(x, w, quantize(w, 4, 32).dequantize())


def test_bad_hessian_raises():
    w = torch.randn(8, 32)
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_quantize(w, -torch.eye(32), 4, 32)
    with pytest.raises(ValueError, match="non-finite"):
        gptq_quantize(w, torch.full((32, 32), float("nan")), 4, 32)
    with pytest.raises(ValueError, match="does not match"):
        gptq_quantize(w, torch.eye(16), 4, 32)
