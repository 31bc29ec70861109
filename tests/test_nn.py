"""genfast.nn.Linear: the one-row reduction path equals F.linear within rounding."""

import pytest
import torch
import torch.nn.functional as F

from genfast.nn import Linear, row_linear


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
