"""genfast.nn.Linear: the one-row reduction, the few-row kernel and the widening GEMM equal F.linear
within rounding."""

import pytest
import torch
import torch.nn.functional as F

from genfast.kernels.linear_few_rows import ops as few_rows
from genfast.kernels.linear_few_rows.ops import MAX_FEW_ROWS
from genfast.kernels.linear_widening_gemm import ops as widening_gemm
from genfast.nn import (
    FP32_PRODUCTS_MIN_ROWS,
    Fp32ProductsConv2d,
    Fp32ProductsLinear,
    Linear,
    auto_weight_dtype,
    row_linear,
    store_linear_weights,
    use_fp32_products,
)

needs_few_rows_kernel = pytest.mark.skipif(
    few_rows.unavailable_reason() is not None, reason=f"few-row kernel: {few_rows.unavailable_reason()}"
)
needs_widening_gemm = pytest.mark.skipif(
    widening_gemm.KERNEL.unavailable_reason() is not None,
    reason=f"widening GEMM: {widening_gemm.KERNEL.unavailable_reason()}",
)


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
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [*range(1, 9), 13, 70])  # past a group of rows, and past a tile
@pytest.mark.parametrize("n,k", [(48, 96), (7, 64), (33, 1536)])  # output counts that are no multiple of a tile
def test_few_rows_kernel_sums_in_fp32(x_dtype, rows, n, k):
    """The kernel's result is the exact dot products of its inputs, up to fp32 summation: bf16
    weights times the rows as given (AVX2) or rounded to bf16 (AVX-512, whose products are bf16)."""
    torch.manual_seed(rows)
    x, w = torch.randn(rows, k).to(x_dtype), torch.randn(n, k).bfloat16()
    got = torch.ops.genfast.linear_few_rows(x, w)
    multiplied = x.bfloat16() if few_rows.KERNEL.loaded_isa() == "avx512" else x
    want = multiplied.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, atol=1e-5 * k**0.5, rtol=1e-6)


@needs_few_rows_kernel
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_few_rows_kernel_gives_each_row_the_same_bits_whatever_the_rows_and_threads_beside_it(x_dtype):
    """What batch-invariant serving rests on (genfast/llm/model/invariance.py): a row's result does
    not depend on how many rows share the call, where it sits among them, or the thread count,
    over in-features that end in whole chains and in a tail (k = 4 x 32 x 3 and 4 x 32 x 3 + 32)."""
    torch.manual_seed(0)
    for k in (384, 416):
        w = torch.randn(300, k).bfloat16()  # tiles of several output rows for the many-row path
        x = torch.randn(75, k).to(x_dtype)
        whole = torch.ops.genfast.linear_few_rows(x, w)
        for start, rows in [(0, 1), (5, 2), (9, 3), (20, 4), (30, 5), (40, 7), (1, 13), (3, 70)]:
            part = torch.ops.genfast.linear_few_rows(x[start : start + rows], w)
            assert torch.equal(part, whole[start : start + rows]), (k, start, rows)
        threads = torch.get_num_threads()
        try:
            for count in (1, 3):
                torch.set_num_threads(count)
                assert torch.equal(torch.ops.genfast.linear_few_rows(x, w), whole), (k, count)
        finally:
            torch.set_num_threads(threads)


@needs_few_rows_kernel
def test_batch_invariant_linear_takes_the_kernel_for_any_row_count_eager_and_compiled():
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=True).bfloat16()
    layer.batch_invariant = True
    x = torch.randn(1, 9, 96).bfloat16()
    want = few_rows.linear(x, layer.weight, layer.bias)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        assert torch.equal(layer(x), want)
        assert torch.equal(compiled(x), want)
        assert torch.equal(compiled(x[:, :4]), want[:, :4])


@needs_few_rows_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_linear_takes_the_few_row_kernel_up_to_its_limit(bias, monkeypatch):
    torch._dynamo.reset()  # one graph per row count: start from none
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=bias).bfloat16()
    traced = []
    kernel = few_rows.linear
    monkeypatch.setattr(few_rows, "linear", lambda *a: traced.append(a[0].shape) or kernel(*a))
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    for rows in range(1, MAX_FEW_ROWS + 3):
        x = torch.randn(1, rows, 96).bfloat16()
        want = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        with torch.inference_mode():
            got = compiled(x)
        assert got.shape == (1, rows, 40) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)  # bf16 output rounding
    # More rows than the limit: aten's GEMM.
    assert traced == [(1, rows, 96) for rows in range(1, MAX_FEW_ROWS + 1)]


@needs_widening_gemm
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 1, 1),
        (5, 17, 40),  # every tile an edge: fewer than 6 rows, 16 + 1 columns, a depth under 8
        (6, 16, 256),  # exactly one 6 x 16 tile, one 256-deep slice
        (13, 33, 257),  # a second slice one deep
        (97, 100, 600),  # past the 96 rows packed at a time
        (7, 4100, 64),  # past the 4096 weight rows packed at a time
    ],
)
def test_widening_gemm_is_the_fp32_product_of_the_widened_weight(m, n, k):
    torch.manual_seed(m + n + k)
    x, w = torch.randn(m, k), torch.randn(n, k).bfloat16()
    got = torch.ops.genfast.linear_widening_gemm(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), x.double() @ w.double().t(), atol=1e-5 * k**0.5, rtol=1e-6)


@needs_widening_gemm
def test_widening_gemm_reads_strided_rows_and_empty_shapes():
    x, w = torch.randn(8, 64).t(), torch.randn(3, 8).bfloat16()  # x not contiguous
    torch.testing.assert_close(torch.ops.genfast.linear_widening_gemm(x, w), x @ w.float().t())
    assert torch.ops.genfast.linear_widening_gemm(torch.randn(0, 8), w).shape == (0, 3)
    assert torch.ops.genfast.linear_widening_gemm(torch.randn(4, 0), w[:, :0]).eq(0).all()
    with pytest.raises(RuntimeError, match="weight must be bf16"):
        torch.ops.genfast.linear_widening_gemm(x, w.float())


@needs_few_rows_kernel
@needs_widening_gemm
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_stored_weights_compute_in_fp32_eager_and_compiled(bias, monkeypatch):
    """Storage bf16, arithmetic fp32 (`--dtype auto` without native bf16): few rows take the
    few-row kernel, more rows (a prefill of any length, compiled with a dynamic row count) the
    widening GEMM, eagerly and compiled; both equal F.linear on the upcast weight."""
    torch._dynamo.reset()  # one graph per row count: start from none
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=bias)
    assert store_linear_weights(layer, torch.bfloat16) == 1
    assert layer.weight.dtype == torch.bfloat16 and (layer.bias is None or layer.bias.dtype == torch.float32)
    taken = []
    for name, module in (("few_rows_linear", few_rows), ("widening_linear", widening_gemm)):
        kernel = module.linear
        monkeypatch.setattr(module, "linear", lambda *a, name=name, kernel=kernel: taken.append(name) or kernel(*a))
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    prefill = torch.compile(layer, fullgraph=True, dynamic=True)
    # AVX-512's kernel multiplies bf16-rounded rows (its products are bf16); AVX2's the fp32 rows.
    tol = 2e-2 if few_rows.KERNEL.loaded_isa() == "avx512" else 1e-5
    for rows, runs, kernel in (
        (1, (layer, compiled), "few_rows_linear"),
        (3, (layer, compiled), "few_rows_linear"),
        (MAX_FEW_ROWS + 2, (layer, compiled, prefill), "widening_linear"),
        (70, (layer, prefill), "widening_linear"),
    ):
        x = torch.randn(rows, 96)
        want = F.linear(x, layer.weight.float(), layer.bias)
        for run in runs:
            taken.clear()
            got = run(x)
            assert got.dtype == torch.float32 and taken == [kernel]
            torch.testing.assert_close(got, want, atol=1e-5 if kernel == "widening_linear" else tol, rtol=tol)


def test_bf16_stored_weights_without_the_kernels_upcast(monkeypatch):
    monkeypatch.setattr(few_rows, "kernel_available", lambda: False)
    monkeypatch.setattr(widening_gemm, "kernel_available", lambda: False)
    layer = Linear(64, 8)
    store_linear_weights(layer, torch.bfloat16)
    for rows in (2, 9):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight.float(), layer.bias))


def test_store_linear_weights_keeps_tied_tables_tied_and_the_rest_as_is():
    model = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(10, 32),
            "head": Linear(32, 10, bias=False),
            "norm": torch.nn.LayerNorm(32),
            "plain": torch.nn.Linear(32, 32),
        }
    )
    model["head"].weight = model["emb"].weight
    assert store_linear_weights(model, torch.bfloat16) == 1
    assert model["head"].weight is model["emb"].weight and model["emb"].weight.dtype == torch.bfloat16
    assert model["norm"].weight.dtype == model["plain"].weight.dtype == torch.float32  # only genfast Linears
    assert store_linear_weights(model, torch.bfloat16) == 0


def test_auto_weight_dtype(monkeypatch):
    cpu = torch.device("cpu")
    assert auto_weight_dtype(cpu, torch.bfloat16) == torch.bfloat16
    assert auto_weight_dtype(torch.device("cuda"), torch.float32) == torch.float32
    monkeypatch.setattr(few_rows, "unavailable_reason", lambda: None)
    assert auto_weight_dtype(cpu, torch.float32) == torch.bfloat16
    monkeypatch.setattr(few_rows, "unavailable_reason", lambda: "this CPU lacks avx2")
    assert auto_weight_dtype(cpu, torch.float32) == torch.float32


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_products_linear_rounds_the_fp32_product_to_bf16(bias):
    """use_fp32_products changes the plain nn.Linears only, sharing their parameters; a bf16 input is
    multiplied in fp32 and rounded to bf16 once, an fp32 one as by nn.Linear."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(96, 40, bias=bias), Linear(40, 24), torch.nn.Sequential(torch.nn.Linear(24, 8))
    )
    model.to(torch.bfloat16)
    first = model[0]
    assert use_fp32_products(model) == 2
    assert type(model[0]) is Fp32ProductsLinear and type(model[2][0]) is Fp32ProductsLinear and type(model[1]) is Linear
    assert model[0].weight is first.weight and model[0].bias is first.bias
    x = torch.randn(2, FP32_PRODUCTS_MIN_ROWS // 2, 96, dtype=torch.bfloat16)
    want = F.linear(x.float(), first.weight.float(), None if first.bias is None else first.bias.float())
    assert torch.equal(model[0](x), want.to(torch.bfloat16))
    few = x[0, :-1]  # fewer rows than widening the weight pays for: bf16 products, as nn.Linear
    assert torch.equal(model[0](few), F.linear(few, first.weight, first.bias))
    model.float()
    assert torch.equal(model[0](x.float()), F.linear(x.float(), model[0].weight, model[0].bias))


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_products_linear_widens_its_weight_in_pieces(bias, monkeypatch):
    """Eager, the weight is widened some output features at a time (16 of 50 here: an uneven last piece):
    the fp32 product of each piece rounded once to bf16, as the whole product is (within one bf16
    rounding step, where a piece's sums land on the other side of a rounding boundary)."""
    from genfast.platform import heap

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 50, bias=bias).to(torch.bfloat16))
    use_fp32_products(model)
    layer = model[0]
    x = torch.randn(2, FP32_PRODUCTS_MIN_ROWS // 2, 96, dtype=torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    asked = []
    monkeypatch.setattr(heap, "items_per_piece", lambda item_bytes: asked.append(item_bytes) or 16)
    got = layer(x)
    assert asked == [(x.shape[0] * x.shape[1] + 96) * 4]  # a product row and a widened weight row
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.float() - want).abs() <= want.abs() * 2**-7).all()


def test_fp32_products_can_be_narrowed_to_one_kind_of_layer():
    """`kinds` limits use_fp32_products to the kinds named (the benchmark's linears-only form)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 8, 1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    assert use_fp32_products(model, kinds=(torch.nn.Linear,)) == 1
    assert type(model[0]) is torch.nn.Conv2d and type(model[2]) is Fp32ProductsLinear
    assert use_fp32_products(model, kinds=(torch.nn.Conv2d,)) == 1
    assert type(model[0]) is Fp32ProductsConv2d and use_fp32_products(model) == 0


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_fp32_products_conv_rounds_the_fp32_convolution_to_bf16(padding_mode):
    """use_fp32_products changes the plain nn.Conv2ds of 64 input channels or more too, keeping every
    hyperparameter and sharing the parameters; a bf16 input (channels-last kept) is convolved in
    fp32 and rounded once."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(64, 10, 3, stride=2, padding=1, dilation=1, groups=2, padding_mode=padding_mode)
    narrow = torch.nn.Conv2d(10, 64, 3)
    model = torch.nn.Sequential(conv, torch.nn.SiLU(), narrow).to(torch.bfloat16)
    assert use_fp32_products(model) == 1 and type(model[2]) is torch.nn.Conv2d  # (FP32_CONV_MIN_CHANNELS)
    wide = model[0]
    assert type(wide) is Fp32ProductsConv2d and wide.weight is conv.weight and wide.bias is conv.bias
    assert (wide.stride, wide.padding, wide.groups, wide.padding_mode) == ((2, 2), (1, 1), 2, padding_mode)
    x = torch.randn(2, 64, 9, 11, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    want = torch.nn.Conv2d(64, 10, 3, stride=2, padding=1, groups=2, padding_mode=padding_mode)
    want.load_state_dict({k: v.float() for k, v in conv.state_dict().items()})
    y = wide(x)
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, want(x.float()).to(torch.bfloat16))
    model.float()
    assert torch.equal(wide(x.float()), want(x.float()))
