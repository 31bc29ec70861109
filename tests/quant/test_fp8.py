"""Dynamic fp8 (genfast/quant/fp8.py) on a CPU, whose torch build runs `_scaled_mm` without fp8
arithmetic: the layer against the product of its own dequantized codes (the call's scales and
layout) and against the float linear (e4m3's rounding); which layers it takes; where it runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from genfast.quant.fp8 import FP8, FP8_MAX, Fp8DynamicLinear, quantize_dynamic_fp8, quantize_rows, unavailable_reason
from genfast.quant.linear import narrower_than

# e4m3 keeps 3 mantissa bits: each code within 2^-4 of its value; a dot product's errors average,
# measured ~3.6% of the output's norm on random data.
FP8_REL_TOL = 0.05


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_rows_use_the_whole_range_and_round_to_within_a_sixteenth():
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1, 10, 100, 1e4, 0.5])[:, None]
    codes, scale = quantize_rows(x)
    assert codes.dtype == FP8 and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.equal(codes.float().abs().amax(dim=1), torch.full((6,), FP8_MAX))
    back = codes.float() * scale
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale * 2**-9).all()  # (subnormal codes: absolute)
    zeros, _ = quantize_rows(torch.zeros(2, 16))
    assert torch.equal(zeros.float(), torch.zeros(2, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_the_layer_is_the_product_of_its_codes(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=bias)
    layer = Fp8DynamicLinear.from_linear(linear)
    x = torch.randn(2, 7, 256).to(dtype)
    y = layer(x)
    assert y.shape == (2, 7, 128) and y.dtype == dtype
    codes, scale = quantize_rows(x.reshape(-1, 256))
    weight = layer.weight_codes.float() * layer.weight_scale.t()
    exact = (codes.float() * scale) @ weight.t() + (0 if linear.bias is None else linear.bias.bfloat16().float())
    torch.testing.assert_close(y.reshape(-1, 128).float(), exact, rtol=2**-7, atol=2**-7 * exact.abs().max().item())
    assert rel_err(y, linear(x.float())) <= FP8_REL_TOL


def test_only_linears_cublas_takes_and_the_filter_leaves_are_replaced():
    model = nn.Sequential(nn.Linear(64, 320), nn.GELU(), nn.Linear(320, 72), nn.Linear(72, 32), nn.Linear(32, 16))
    names = quantize_dynamic_fp8(model, keep=narrower_than(32))
    assert names == ["0"]  # 72 is no multiple of 16; 32 -> 16 is narrower than 32
    assert isinstance(model[0], Fp8DynamicLinear) and type(model[2]) is nn.Linear and type(model[3]) is nn.Linear
    assert type(model[4]) is nn.Linear
    assert model(torch.randn(3, 64)).shape == (3, 16)


def test_it_needs_a_gpu_with_fp8_tensor_cores(monkeypatch):
    assert "need a CUDA GPU of compute capability 8.9" in unavailable_reason(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "A100 has 8.0" in unavailable_reason(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert unavailable_reason(torch.device("cuda")) is None
