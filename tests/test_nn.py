"""genfast.nn.Linear: the one-row reduction and the few-row kernel equal F.linear within rounding."""

import pytest
import torch
import torch.nn.functional as F

import genfast.nn
from genfast.nn import MAX_FEW_ROWS, Linear, few_rows_unavailable_reason, row_linear

needs_few_rows_kernel = pytest.mark.skipif(few_rows_unavailable_reason() is not None,
                                           reason=f"few-row kernel: {few_rows_unavailable_reason()}")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_row_linear_matches_f_linear(dtype, atol, bias):
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=bias).to(dtype)
    x = torch.randn(1, 1, 96, dtype=dtype)
    want = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    got = row_linear(x, layer.weight, layer.bias)
    assert got.shape == (1, 1, 40) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


def test_compiled_linear_takes_the_reduction_and_agrees():
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True)
    x = torch.randn(1, 64)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=0)
    many = torch.randn(5, 64)  # several rows: the library matmul
    torch.testing.assert_close(compiled(many), layer(many), atol=1e-5, rtol=0)


def test_state_dict_is_nn_linear_compatible():
    plain = torch.nn.Linear(8, 4)
    ours = Linear(8, 4)
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(3, 8)
    torch.testing.assert_close(ours(x), plain(x))


@needs_few_rows_kernel
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("n,k", [(48, 96), (7, 64), (33, 1536)])  # output counts that are no multiple of a tile
def test_few_rows_kernel_sums_in_fp32(rows, n, k):
    """The kernel's result is the exact dot products of the bf16 inputs, up to fp32 summation."""
    torch.manual_seed(rows)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    got = torch.ops.genfast.linear_few_rows(x, w)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, atol=1e-5 * k ** 0.5, rtol=1e-6)


@needs_few_rows_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_linear_takes_the_few_row_kernel_up_to_its_limit(bias, monkeypatch):
    torch._dynamo.reset()  # one graph per row count: start from none
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=bias).bfloat16()
    traced = []
    kernel = genfast.nn.few_rows_linear
    monkeypatch.setattr(genfast.nn, "few_rows_linear", lambda *a: traced.append(a[0].shape) or kernel(*a))
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    for rows in range(2, MAX_FEW_ROWS + 3):
        x = torch.randn(1, rows, 96).bfloat16()
        want = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        with torch.inference_mode():
            got = compiled(x)
        assert got.shape == (1, rows, 40) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)  # bf16 output rounding
    assert traced == [(1, rows, 96) for rows in range(2, MAX_FEW_ROWS + 1)]  # more rows: aten's GEMM
