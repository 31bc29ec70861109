"""Weight-only int8: every kernel path equals the reference dequantized matmul."""

import pytest
import torch
import torch.nn.functional as F

from genfast.quant.weight_only import Int8Linear, quantize_int8_per_channel, quantize_linears_int8


def reference(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.dequantize(), bias)


@pytest.mark.parametrize("shape", [(48, 64), (33, 17), (1, 5), (256, 96)])
def test_rounding_error_is_at_most_half_a_step(shape):
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    q, scales = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert ((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [64, 72])  # 72: not a multiple of 16, takes the fallback
def test_eager_kernel_matches_dequantized_reference(dtype, atol, rows, bias, in_features):
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(torch.nn.Linear(in_features, 40, bias=bias).to(dtype))
    x = torch.randn(rows, in_features, dtype=dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 40)
    torch.testing.assert_close(got.float(), reference(layer, x), atol=atol, rtol=0)


def test_compiled_one_row_path_matches_reference():
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(torch.nn.Linear(96, 50, bias=True).to(torch.bfloat16))
    x = torch.randn(1, 1, 96, dtype=torch.bfloat16)
    got = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(got.float(), reference(layer, x), atol=3e-2, rtol=0)


def test_quantized_tiny_model_stays_close(tmp_path):
    """Accuracy budget on a tiny random Llama: logits cosine >= 0.999 vs the unquantized model."""
    from tests.llm.hf_fixtures import tiny_genfast_model

    _, model = tiny_genfast_model("llama3", tmp_path)
    tokens = torch.randint(0, 320, (1, 24))
    pos = torch.arange(24)
    with torch.no_grad():
        want = model(tokens, pos, all_logits=True)[0]
        assert quantize_linears_int8(model) == 2 * 4 + 1  # 4 per layer + the output head
        got = model(tokens, pos, all_logits=True)[0]
    assert isinstance(model.output, Int8Linear)
    assert F.cosine_similarity(got, want, dim=-1).min() >= 0.999


def test_filter_keeps_layers_unquantized(tmp_path):
    from tests.llm.hf_fixtures import tiny_genfast_model

    _, model = tiny_genfast_model("smollm", tmp_path)
    n = quantize_linears_int8(model, keep=lambda name, m: name == "output")
    assert n == 3 * 4 and isinstance(model.output, torch.nn.Linear)


def test_compiled_several_rows_with_dynamic_length():
    """The prefill shape: a dynamic number of rows produced by a fused op before the layer."""
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16))

    def prefill(x):
        return layer(torch.nn.functional.silu(x) * 2)

    from genfast.compile import compile_fn

    compiled = compile_fn(prefill, "cpu", decode=False)  # genfast's options (freezing)
    with torch.inference_mode():
        for rows in (3, 9):
            x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 1)
            want = reference(layer, torch.nn.functional.silu(x) * 2)
            torch.testing.assert_close(compiled(x).float(), want, atol=5e-2, rtol=0)
