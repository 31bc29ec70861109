"""Quantization grids, the kernel layout and QuantLinear against the dequantized reference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from genfast.kernels.qlinear import ops as kernels
from genfast.quant.grids import QuantizedWeight, check_group_size, pack_nibbles, quantize, unpack_nibbles
from genfast.quant.linear import QuantLinear, _int8_product, quantize_linears
from tests.cpus import ZEN3, pretend_cpu

NATIVE = kernels.available()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"native kernel unavailable: {kernels.unavailable_reason()}")

# Native kernel budget: activations are quantized to int8 per block of 32 (~0.4% error per value),
# so outputs stay within 2% relative (Frobenius) of the exact product with the same weights.
NATIVE_REL_TOL = 2e-2
SCHEMES = [(8, None), (8, 32), (4, 32), (4, 64), (4, 128), (4, 256)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("bits,group_size", SCHEMES)
@pytest.mark.parametrize("shape", [(48, 64), (33, 72), (5, 300)])
def test_rounding_error_is_at_most_half_a_step(bits, group_size, shape):
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    qw = quantize(w, bits, group_size)
    assert qw.codes.dtype == torch.uint8
    assert qw.codes.min() >= 1 if bits == 8 else qw.codes.max() <= 15  # int8: q = u - 128 in [-127, 127]
    assert qw.codes.shape[1] % qw.group_size == 0 and qw.codes.shape[1] >= shape[1]
    step = qw.scales.float().repeat_interleave(qw.group_size, dim=1)[:, : shape[1]]
    assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-6 * w.abs().max()).all()


def test_int8_is_symmetric_and_zero_is_exact():
    w = torch.randn(16, 64)
    w[:, :5] = 0
    assert (quantize(w, 8, 32).dequantize()[:, :5] == 0).all()
    qw = quantize(w, 8)
    assert torch.equal(qw.mins.float(), -128 * qw.scales.float())


def test_bad_group_sizes_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        check_group_size(4, 48, 96)
    with pytest.raises(ValueError, match="one of"):
        check_group_size(4, 96, 512)
    with pytest.raises(ValueError, match="bits"):
        check_group_size(3, 32, 64)


def test_nibble_and_tile_layouts_round_trip():
    codes = torch.randint(0, 16, (48, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    for bits, top in ((8, 256), (4, 16)):
        codes = torch.randint(0, top, (128, 96), dtype=torch.uint8)
        packed = kernels.pack_tiles(codes, bits)
        assert packed.numel() == codes.numel() * bits // 8
        assert torch.equal(kernels.unpack_tiles(packed, bits, 128, 96), codes)


@pytest.mark.parametrize("bits,group_size", [(8, 96), (8, 32), (4, 32), (4, 96)])
def test_each_groups_scales_follow_its_codes_in_one_stream_per_row_group(bits, group_size):
    n, k = 128, 96
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    scales, mins = torch.randn(n, k // group_size).half(), torch.randn(n, k // group_size).half()
    packed = kernels.pack(codes, scales, mins, bits)
    assert packed.numel() == n * k * bits // 8 + 4 * n * (k // group_size)
    code_bytes = group_size * kernels.ROW_GROUP * bits // 8
    group_bytes = code_bytes + 4 * kernels.ROW_GROUP
    tiles = kernels.pack_tiles(codes, bits).reshape(n // kernels.ROW_GROUP, k // group_size, code_bytes)
    for s in range(n // kernels.ROW_GROUP):
        rows = slice(s * kernels.ROW_GROUP, (s + 1) * kernels.ROW_GROUP)
        for g in range(k // group_size):
            start = (s * (k // group_size) + g) * group_bytes
            assert torch.equal(packed[start : start + code_bytes], tiles[s, g])
            grid = packed[start + code_bytes : start + group_bytes].view(torch.float16)
            assert torch.equal(grid[: kernels.ROW_GROUP], scales[rows, g])
            assert torch.equal(grid[kernels.ROW_GROUP :], mins[rows, g])
    assert all(torch.equal(a, b) for a, b in zip(kernels.unpack(packed, bits, n, k, group_size), (codes, scales, mins)))


def make_layer(in_features, out_features, bits, group_size, bias, dtype, native, monkeypatch):
    if not native:
        monkeypatch.setattr(kernels, "available", lambda: False)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    layer = QuantLinear.from_linear(linear, bits, group_size)
    if layer.bias is not None:
        layer.bias = layer.bias.to(dtype)
    assert layer.native == native
    return layer


def reference(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.dequantize(), bias)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("bits,group_size", SCHEMES)
@pytest.mark.parametrize("in_features,out_features", [(64, 48), (72, 40)])  # 72/40: padded columns and rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_matches_dequantized_reference(native, bits, group_size, in_features, out_features, dtype, monkeypatch):
    torch.manual_seed(0)
    layer = make_layer(in_features, out_features, bits, group_size, True, dtype, native, monkeypatch)
    for rows in (1, 7):
        x = torch.randn(2, rows, in_features, dtype=dtype)
        got = layer(x)
        assert got.dtype == dtype and got.shape == (2, rows, out_features)
        # fallback: exact up to the activation dtype (bf16 products are rounded to bf16)
        tol = NATIVE_REL_TOL if native else (1e-5 if dtype == torch.float32 else 1e-2)
        assert rel_err(got, reference(layer, x)) < tol


@pytest.mark.parametrize("bits,group_size", [(8, None), (4, 64)])
def test_quantized_weight_round_trips_through_the_layer(bits, group_size):
    qw = quantize(torch.randn(40, 72), bits, group_size)
    back = QuantLinear(qw).quantized_weight()
    for name in ("codes", "scales", "mins"):
        assert torch.equal(getattr(back, name), getattr(qw, name)), name
    assert (back.bits, back.group_size, back.in_features) == (qw.bits, qw.group_size, qw.in_features)


def test_a_layer_keeps_the_activation_dtype_it_was_made_for():
    """CUDA's int4 kernel depends on it (tinygemm takes bf16 only); tensor-parallel shards keep it."""
    from genfast.llm.tensor_parallel import _rows

    linear = nn.Linear(64, 40).to(torch.bfloat16)
    layer = QuantLinear.from_linear(linear, 4, 32)
    assert layer.activation_dtype == torch.bfloat16
    assert QuantLinear(quantize(torch.randn(40, 64), 8)).activation_dtype is None
    assert _rows(layer, torch.arange(8)).activation_dtype == torch.bfloat16


def test_a_named_kernel_overrides_the_choice_and_an_unknown_one_is_refused():
    qw = quantize(torch.randn(40, 64), 4, 32)
    assert QuantLinear(qw, kernel="dequantize").kernel == "dequantize"
    with pytest.raises(ValueError, match="unknown kernel 'tinygemm'"):
        QuantLinear(qw, kernel="tinygemm")


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
def test_compiled_layer_matches_eager(native, monkeypatch):
    """One-row decode shape and a dynamic number of rows behind a fused op (prefill shape)."""
    from genfast.compilation.inductor import compile_fn

    torch.manual_seed(0)
    layer = make_layer(96, 50, 4, 32, True, torch.bfloat16, native, monkeypatch)

    def step(x):
        return layer(F.silu(x) * 2)

    compiled = compile_fn(step, "cpu", decode=False)
    with torch.inference_mode():
        for rows in (1, 3, 9):
            x = torch.randn(1, rows, 96, dtype=torch.bfloat16)
            if rows > 1:
                torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(compiled(x).float(), step(x).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "bits,group_size,min_cosine", [(8, None, 0.999), (4, 32, 0.98)]
)  # int4: 16 levels per group of random weights
def test_quantized_tiny_model_stays_close(bits, group_size, min_cosine, tmp_path):
    from tests.llm.hf_fixtures import tiny_genfast_model

    _, model = tiny_genfast_model("llama3", tmp_path)
    tokens = torch.randint(0, 320, (1, 24))
    pos = torch.arange(24)
    with torch.no_grad():
        want = model(tokens, pos, all_logits=True)[0]
        assert len(quantize_linears(model, bits, group_size)) == 2 * 4 + 1  # 4 per layer + the head
        got = model(tokens, pos, all_logits=True)[0]
    assert isinstance(model.output, QuantLinear)
    assert F.cosine_similarity(got, want, dim=-1).min() >= min_cosine


def test_filter_keeps_layers_unquantized(tmp_path):
    from tests.llm.hf_fixtures import tiny_genfast_model

    _, model = tiny_genfast_model("smollm", tmp_path)
    names = quantize_linears(model, 8, keep=lambda name, m: name == "output")
    assert len(names) == 3 * 4 and isinstance(model.output, torch.nn.Linear)


def test_quantized_weight_dequantize_drops_padding():
    qw = QuantizedWeight(
        torch.full((2, 64), 3, dtype=torch.uint8),
        torch.ones(2, 2, dtype=torch.float16),
        torch.full((2, 2), -1.0, dtype=torch.float16),
        4,
        32,
        40,
    )
    assert torch.equal(qw.dequantize(), torch.full((2, 40), 2.0))


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("rows", [1, 40, 130])
def test_dynamic_int8_matches_reference(native, rows, monkeypatch):
    """Per-token int8 activations (native kernel, or torch._int_mm; fp32 on a CPU without VNNI, where
    oneDNN's int8 GEMM saturates): within 2% of the float layer."""
    if not native:
        monkeypatch.setattr(kernels, "available", lambda: False)
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(72, 40), 8, dynamic=True)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, 72, dtype=dtype)
        got = layer(x)
        assert got.dtype == dtype
        assert rel_err(got, reference(layer, x)) < NATIVE_REL_TOL


@pytest.mark.parametrize("flags", [ZEN3, None])
def test_int8_product_is_exact_with_or_without_vnni(flags, monkeypatch):
    """Full-range int8 operands, the case where oneDNN's int8 GEMM without VNNI saturates; a ZEN3
    CPU takes the fp32 product, this machine its own path."""
    if flags is not None:
        pretend_cpu(monkeypatch, flags)
    torch.manual_seed(0)
    for m in (1, 17, 40):
        a = torch.randint(-128, 128, (m, 288), dtype=torch.int8)
        b = torch.randint(-128, 128, (288, 40), dtype=torch.int8)
        assert torch.equal(_int8_product(a, b).long(), a.long() @ b.long())


@needs_native
@pytest.mark.parametrize("rows, k, n", [(1, 64, 64), (7, 96, 40), (130, 288, 200)])
def test_native_dynamic_int8_equals_its_integer_math(rows, k, n):
    """The kernel against the same per-token quantization done in float64: only rounding of the
    final fp32 products differs (row tails, output tails and row chunks of 64 included)."""
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False), 8, dynamic=True)
    x = torch.randn(rows, k)
    scale = x.abs().amax(dim=1, keepdim=True) / kernels.dynamic_activation_max()
    xq = torch.round(x / scale)
    codes, scales, mins = (
        t.double()
        for t in (layer.quantized_weight().codes[:, :k], layer.quantized_weight().scales, layer.quantized_weight().mins)
    )
    expected = scale.double() * (xq.double() @ (codes * scales + mins).t())
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_dynamic_int8_epilogue_adds_the_bias_then_the_exact_gelu(dtype):
    """The kernel's epilogue against the same kernel's plain outputs with the bias added and
    F.gelu applied in fp32: the bias and GELU act on the fp32 outputs before they are rounded
    (bf16: one rounding, so within one bf16 step), and the GELU's erf approximation stays within
    fp32's reach over outputs from -12 to 12 (both tails: x and 0), output tails (40 of 48 rows
    of a tile) and row tails included."""
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(nn.Linear(96, 40).to(dtype), 8, dynamic=True)
    x = (torch.randn(37, 96) * torch.linspace(0.1, 8.0, 37)[:, None]).to(dtype)
    plain = torch.ops.genfast.qlinear_dynamic(x.float(), layer.packed, 40)  # fp32: nothing rounded
    assert plain.abs().max() > 8 and (plain < -4).any()  # a wide range of GELU inputs
    expected = F.gelu(plain + layer.bias.float())
    got = torch.ops.genfast.qlinear_dynamic(x, layer.packed, 40, layer.bias, True)
    assert got.dtype == dtype
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-5, rtol=2**-8)
    torch.testing.assert_close(got.float(), expected, **tolerance)
    # The bias alone; and the layer's own call (bias in the kernel) against its GELU applied after
    # (in bf16 after a rounding of its own: two bf16 steps apart at most).
    torch.testing.assert_close(
        torch.ops.genfast.qlinear_dynamic(x, layer.packed, 40, layer.bias).float(),
        plain + layer.bias.float(),
        **tolerance,
    )
    after = tolerance if dtype == torch.float32 else dict(atol=2**-7, rtol=2**-7)
    torch.testing.assert_close(layer(x, activation="gelu").float(), F.gelu(layer(x).float()), **after)


@pytest.mark.parametrize("native", [True, False])
def test_quant_linear_gelu_is_gelu_after_the_layer(native, monkeypatch):
    """layer(x, activation="gelu") on every path: GELU(layer(x)); an unknown activation is refused."""
    if native and not NATIVE:
        pytest.skip(f"native kernel unavailable: {kernels.unavailable_reason()}")
    if not native:
        monkeypatch.setattr(kernels, "available", lambda: False)
    torch.manual_seed(1)
    layer = QuantLinear.from_linear(nn.Linear(64, 24), 8, dynamic=True)
    x = torch.randn(5, 3, 64)
    torch.testing.assert_close(layer(x, activation="gelu"), F.gelu(layer(x)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown activation"):
        layer(x, activation="relu")


def test_dynamic_int8_filter_hook_and_validation(tmp_path):
    from genfast.quant.grids import quantize
    from genfast.quant.linear import quantize_dynamic_int8
    from tests.llm.hf_fixtures import tiny_genfast_model

    _, model = tiny_genfast_model("llama3", tmp_path)
    names = quantize_dynamic_int8(model, keep=lambda name, linear: linear.in_features < 100)
    assert names == [f"layers.{i}.feed_forward.w2" for i in range(2)]  # the only layers with K >= 100
    assert all(model.get_submodule(n).dynamic for n in names)
    with pytest.raises(ValueError, match="per output channel"):
        QuantLinear(quantize(torch.randn(8, 64), 4, 32), dynamic=True)


@needs_native
@pytest.mark.parametrize("bits,group_size", [(8, None), (8, 64), (4, 32), (4, 128)])
@pytest.mark.parametrize("rows", [1, 5])
def test_native_weight_only_equals_its_integer_math(bits, group_size, rows):
    """Every kernel variant (AVX-512 VNNI, AVX2) computes these exact integer sums: activations
    quantized to int8 per block of 32, codes times int8 summed per block, scaled in fp32. Only the
    order of the fp32 additions differs between variants."""
    torch.manual_seed(0)
    k, n = 256, 80
    layer = QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False), bits, group_size)
    qw = layer.quantized_weight()
    x = torch.randn(rows, k)
    blocks = x.reshape(rows, k // 32, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    xq = torch.round(blocks / scale) * scale  # the dequantized int8 activations
    expected = xq.reshape(rows, k).double() @ qw.dequantize(torch.float64).t()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
