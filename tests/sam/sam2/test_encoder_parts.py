"""The pieces of SAM 2's image encoder that are written for speed, each against the plain
computation it replaces: the native attention kernel without a bias, the fused linear layers,
the position tables as matrix products and buffers, the max pooling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genfast.kernels.rel_pos_attention import ops as kernel
from genfast.sam.modeling.attention import sam2_attention
from genfast.sam.sam2.build import build_random_sam2
from genfast.sam.sam2.config import tiny_sam2_config
from genfast.sam.sam2.modeling.hiera import _pool, bicubic_matrix
from genfast.sam.sam2.modeling.linear import Linear, dense_linear, linear, linear_gelu
from genfast.sam.sam2.modeling.position import PositionEmbeddingSine

KERNEL_DTYPES = kernel.DTYPES.get(kernel.loaded_isa(), ()) if kernel.unavailable_reason() is None else ()


@pytest.mark.skipif(not KERNEL_DTYPES, reason="no native attention kernel here")
@pytest.mark.parametrize(("dtype", "fp32"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize(
    ("windows", "heads", "queries", "keys", "channels"),
    [
        (1, 2, 100, 100, 32),
        (6, 2, 16, 64, 96),
        (3, 1, 49, 196, 16),
        (2, 3, 5, 7, 48),
        (2, 8, 300, 8, 16),  # at most 16 keys, many queries: 16 rows at a time; two tasks a head, a partial group
        (1, 2, 256, 16, 32),  # the same with exactly 16 keys, two vectors of channels
        (1, 1, 260, 1, 16),  # one key: every probability 1
        (1, 1, 130, 4500, 256),  # the memory attention's head dim; keys in chunks (more than 4096)
        (1, 2, 37, 300, 112),  # heads wider than one register tile of the output: channel slices 4 + 3 vectors
        (2, 1, 23, 90, 160),  # slices 4 + 4 + 2; rows not a multiple of any tile's
        # The AMX variant's tiles: rows past whole 32-row groups; keys padded to 32 in one pass and
        # in chunks; with the AVX-512 variant's code for heads of 16-channel remainders above.
        (2, 2, 70, 290, 64),
        (1, 1, 45, 4130, 96),
        (1, 2, 40, 3000, 96),  # in chunks on the tiles only (K past their one-pass bound)
    ],
)
def test_attention_kernel_matches_sdpa(dtype, fp32, windows, heads, queries, keys, channels) -> None:
    """Any query and key counts (pooled queries: fewer than keys), q, k, v strided views of one
    qkv product as the encoder passes them. bf16 inputs on bf16 dot products (P rounded to bf16)
    within 2e-2; on fp32 FMAs within the output's own rounding to bf16 (2^-8 relative) and 1e-3:
    the products of bf16 operands are exact in fp32."""
    if dtype not in KERNEL_DTYPES:
        pytest.skip(f"the {kernel.loaded_isa()} kernel takes no {dtype}")
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(windows, keys, 3, heads, channels, generator=gen).to(dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    q = q[:, :, :queries]
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    actual = kernel.attention(q, k, v, channels**-0.5, fp32=fp32)
    assert actual.shape == expected.shape and actual.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
    elif fp32:
        torch.testing.assert_close(actual.float(), expected, atol=1e-3, rtol=2**-8)
    else:
        torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not KERNEL_DTYPES, reason="no native attention kernel here")
@pytest.mark.parametrize(("int8", "fp32"), [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize(
    ("queries", "keys", "channels", "value_channels"),
    [
        (70, 300, 256, 64),  # SAM 2's memory attention: keys of 256 channels, the memory's 64 as values
        (130, 4500, 256, 64),  # the same with keys in chunks
        (300, 9, 64, 32),  # few keys, many queries: the general path (the few-key one takes equal widths)
        (40, 200, 32, 96),  # values wider than the keys
        (33, 100, 96, 16),  # a value width that no AMX tile takes (its AVX-512 code runs)
    ],
)
def test_attention_kernel_takes_values_of_another_width(queries, keys, channels, value_channels, int8, fp32) -> None:
    """v [B, heads, Nk, Cv] with Cv other than q's and k's C: [B, heads, Nq, Cv] out, within the
    tolerances of the tests above (bf16 products 2e-2; fp32 FMAs 1e-3 and 2^-8; int8 products 4%
    of the norm), in every dtype the variant takes."""
    if int8 and not INT8_PRODUCTS:
        pytest.skip("the loaded attention kernel has no int8 products (AVX-512 only)")
    gen = torch.Generator().manual_seed(5)
    for dtype in KERNEL_DTYPES:
        q, k = (torch.randn(2, 1, n, channels, generator=gen).to(dtype) for n in (queries, keys))
        v = torch.randn(2, 1, keys, value_channels, generator=gen).to(dtype)
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        actual = kernel.attention(q, k, v, channels**-0.5, int8, int8, fp32)
        assert actual.shape == expected.shape and actual.dtype == dtype
        if int8:
            assert ((actual.float() - expected).norm() / expected.norm()).item() < 0.04
        elif dtype == torch.float32:
            torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
        elif fp32 or kernel.loaded_isa() == "avx2":
            torch.testing.assert_close(actual.float(), expected, atol=1e-3, rtol=2**-8)
        else:
            torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not KERNEL_DTYPES, reason="no native attention kernel here")
def test_attention_kernel_rejects_value_widths_it_cannot_take() -> None:
    q, k = (torch.randn(1, 1, 20, 32).to(KERNEL_DTYPES[0]) for _ in range(2))
    for v in (torch.randn(1, 1, 20, 24), torch.randn(1, 1, 20, 272), torch.randn(1, 1, 19, 32)):
        with pytest.raises(RuntimeError, match=r"head dims must be 16|v \[B, heads, Nk, Cv\]"):
            torch.ops.genfast.attention(q, k, v.to(q.dtype), 32**-0.5)


@pytest.mark.skipif(not KERNEL_DTYPES, reason="no native attention kernel here")
def test_attention_kernel_multiplies_in_fp32_where_bf16_products_are_slow(monkeypatch) -> None:
    """The AVX-512 variant's products run on fp32 FMAs by default exactly where bf16 dot products
    are slower than fp32 FMAs (Intel's cores, with AMX or without); the AVX2 variant computes in
    fp32 anyway, and bf16 products are never asked of it. The two forms differ (P in bf16 or fp32)."""
    from genfast.platform import hardware

    for fast in (True, False):
        monkeypatch.setattr(hardware, "fast_bf16_dot_products", lambda fast=fast: fast)
        assert kernel.fp32_products() == (kernel.loaded_isa() == "avx512" and not fast)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 32, generator=gen).to(KERNEL_DTYPES[-1]) for n in (40, 300, 300))
    by_default = kernel.attention(q, k, v, 32**-0.5)
    assert torch.equal(by_default, kernel.attention(q, k, v, 32**-0.5, fp32=kernel.fp32_products()))
    if kernel.loaded_isa() == "avx512":
        fp32, bf16 = (kernel.attention(q, k, v, 32**-0.5, fp32=fp32) for fp32 in (True, False))
        assert not torch.equal(fp32, bf16)


@pytest.mark.skipif(not KERNEL_DTYPES, reason="no native attention kernel here")
def test_attention_kernel_rescales_when_a_later_chunk_holds_the_maximum() -> None:
    """Keys in chunks (online softmax): scores growing along the keys move each row's maximum in
    every chunk, so each chunk rescales what the earlier ones summed; the padded last chunk too."""
    gen = torch.Generator().manual_seed(1)
    dtype = KERNEL_DTYPES[0]
    keys = 5000
    direction = torch.randn(32, generator=gen)
    q = (direction + 0.3 * torch.randn(1, 1, 40, 32, generator=gen)).to(dtype)
    growth = torch.linspace(0.0, 0.7, keys)[:, None]  # scores from ~0 to ~4
    k = (direction * growth + 0.3 * torch.randn(1, 1, keys, 32, generator=gen)).to(dtype)
    v = torch.randn(1, 1, keys, 32, generator=gen).to(dtype)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel.attention(q, k, v, 32**-0.5).float(), expected, atol=tolerance, rtol=tolerance)


INT8_PRODUCTS = KERNEL_DTYPES and kernel.has_int8_products()


@pytest.mark.skipif(not INT8_PRODUCTS, reason="the loaded attention kernel has no int8 products (AVX-512 only)")
@pytest.mark.parametrize(
    ("int8_scores", "int8_values", "fp32"),
    [(True, False, False), (False, True, False), (True, True, False), (True, False, True), (False, True, True)],
)
@pytest.mark.parametrize(
    ("windows", "queries", "keys", "channels"),
    [
        (2, 5, 40, 32),  # one task per head: the task quantizes its own keys
        (1, 130, 4500, 256),  # the memory attention's head dim, keys in chunks, keys shared by the tasks
        (1, 70, 300, 112),  # heads of 7 vectors; rows not a multiple of a tile's; a partial block of keys
    ],
)
def test_attention_kernel_int8_products_match_sdpa(
    windows, queries, keys, channels, int8_scores, int8_values, fp32
) -> None:
    """Either product or both on int8 codes (the other on bf16 dot products or fp32 FMAs): the
    output within 4% of its norm of fp32 SDPA on the same bf16 inputs (measured ~1-2%: each code
    rounds to 1/254 of its row's or block's range; bf16 is ~0.2%), scores sharp enough (std ~2)
    that their errors show. A query row and a key of zeros (scale 0) take part, and a channel of V
    that is zero in every key (scale 0)."""
    gen = torch.Generator().manual_seed(2)
    q = (2 * torch.randn(windows, 1, queries, channels, generator=gen)).bfloat16()
    k, v = (torch.randn(windows, 1, keys, channels, generator=gen).bfloat16() for _ in range(2))
    q[:, :, 3] = 0
    k[:, :, 5] = 0
    v[..., 7] = 0
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    actual = kernel.attention(q, k, v, channels**-0.5, int8_scores, int8_values, fp32).float()
    without_int8 = kernel.attention(q, k, v, channels**-0.5, fp32=fp32).float()
    error = ((actual - expected).norm() / expected.norm()).item()
    assert error < 0.04 and not torch.equal(actual, without_int8), error
    torch.testing.assert_close(actual[:, :, 3], expected[:, :, 3], atol=2e-2, rtol=2e-2)  # a uniform softmax
    assert not actual[..., 7].any()


@pytest.mark.skipif(not INT8_PRODUCTS, reason="the loaded attention kernel has no int8 products (AVX-512 only)")
@pytest.mark.parametrize("keys", [4096, 5000])  # one pass over the keys; in chunks (and a partial block)
def test_attention_kernel_int8_values_keep_a_sinks_broad_tail(keys) -> None:
    """Every query puts half its mass on one key (an attention sink) and spreads the other half
    over thousands of keys, each ~1/4000 of the sink's probability, whose values share a mean. With
    one scale per row for P's u8 codes every tail key would round to 0 and the output would lose
    the tail's half (all of the output here). With a scale per block of keys only the sink's own
    block drops its tail (~6% of the output here), and the kernel takes that mass back on the
    block's mean of V. The output within 2% of its norm of fp32 SDPA (measured ~0.2%, as bf16's)."""
    gen = torch.Generator().manual_seed(3)
    channels = 96
    q = torch.zeros(1, 2, 64, channels)
    q[..., 0] = 1.0
    k = 0.02 * torch.randn(1, 2, keys, channels, generator=gen)
    k[:, :, 100, 0] = channels**0.5 * torch.log(torch.tensor(keys - 1.0))  # p(sink) = 1/2
    mean = torch.randn(channels, generator=gen)
    v = mean + 0.5 * torch.randn(1, 2, keys, channels, generator=gen)
    v[:, :, 100] = 0  # the sink's value (sinks' are small): the output is the tail's half
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    actual = kernel.attention(q, k, v, channels**-0.5, int8_values=True).float()
    tail = expected.norm(dim=-1)
    assert (tail > 0.4 * mean.norm()).all()  # ~ half the tail's mean
    error = ((actual - expected).norm() / expected.norm()).item()
    assert error < 0.02, error


@pytest.mark.skipif(not KERNEL_DTYPES or INT8_PRODUCTS, reason="a kernel variant without int8 products (AVX2, AMX)")
def test_int8_products_are_refused_where_the_kernel_has_none() -> None:
    """The AVX2 and AMX variants refuse int8 products; asked through attention_or_sdpa, they compute as without."""
    q, k, v = (torch.randn(1, 1, n, 32, generator=torch.Generator().manual_seed(n)) for n in (8, 1100, 1100))
    for flags in ((True, False), (False, True)):
        with pytest.raises(RuntimeError, match="int8 products need the AVX-512 variant"):
            torch.ops.genfast.attention(q, k, v, 32**-0.5, *flags)
        assert torch.equal(kernel.attention_or_sdpa(q, k, v, *flags), kernel.attention_or_sdpa(q, k, v))


@pytest.mark.skipif(not KERNEL_DTYPES, reason="no native attention kernel here")
def test_sam2_attention_takes_the_kernel_where_it_pays(monkeypatch) -> None:
    """The AVX2 variant (fp32 arithmetic) only on Hiera's global blocks; SDPA on windows and on
    the memory attention's many keys. The AVX-512 variant everywhere, except on a CPU with AMX
    (SDPA's products on its tiles), where it keeps only the attentions over a few keys. The AMX
    variant (its products on the tiles too) everywhere, but for heads its tiles do not take."""
    from genfast.platform import hardware

    q, k, v = (torch.randn(1, 2, n, 16).to(KERNEL_DTYPES[0]) for n in (8, 16, 16))
    calls = []
    monkeypatch.setattr(kernel, "attention", lambda *args: calls.append(args) or args[0])
    sam2_attention(q, k, v, "fused")
    assert len(calls) == (kernel.loaded_isa() != "avx2")
    avx2, amx_variant = kernel.loaded_isa() == "avx2", kernel.loaded_isa() == "amx"
    if amx_variant:
        assert not kernel.attention_pays(4096, 4096, 48) and kernel.attention_pays(4096, 16, 48)
    for amx in (False, True):
        monkeypatch.setattr(hardware, "has_amx_bf16", lambda amx=amx: amx)
        many_keys = amx_variant or (not avx2 and not amx)  # the AMX variant, or the AVX-512 one without AMX
        assert kernel.attention_pays(4096, 4096, 96) == (avx2 or many_keys)
        assert kernel.attention_pays(16, 16, 96) == (not avx2)  # a few keys: AMX or not
        assert kernel.attention_pays(4096, 7 * 4096 + 64, 256) == many_keys
        assert kernel.attention_pays(4096, 4096, 256) == many_keys
        assert kernel.attention_pays(196, 196, 96) == many_keys  # a window of Hiera's third stage


def test_sam2_attention_math_is_the_explicit_softmax() -> None:
    q, k, v = (torch.randn(2, 2, n, 16, generator=torch.Generator().manual_seed(n)) for n in (4, 9, 9))
    expected = ((q * 16**-0.5) @ k.transpose(-2, -1)).softmax(dim=-1) @ v
    torch.testing.assert_close(sam2_attention(q, k, v, "math"), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_dense_linear_is_linear_then_activation(dtype, activation) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 7, 48, generator=gen).to(dtype)
    weight, bias = torch.randn(80, 48, generator=gen).to(dtype), torch.randn(80, generator=gen).to(dtype)
    expected = F.linear(x.float(), weight.float(), bias.float())
    expected = F.gelu(expected) if activation == "gelu" else expected
    actual = dense_linear(x, weight, bias, activation)
    assert actual.shape == (2, 5, 7, 80) and actual.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)
    compiled = torch.compile(lambda x: dense_linear(x, weight, bias, activation), fullgraph=True)
    torch.testing.assert_close(compiled(x), actual)


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_bf16_layers_multiply_in_fp32_where_bf16_products_are_slow(monkeypatch, fast_bf16) -> None:
    """Where the CPU's bf16 products are slower than its fp32 ones (`hardware.fast_bf16_products`)
    a bf16 layer hands oneDNN fp32 operands and returns bf16: the fp32 result rounded once. The
    same in a compiled graph, where the decision is a constant."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from genfast.platform import hardware
    from genfast.sam.sam2.modeling import linear as linear_module

    monkeypatch.setattr(hardware, "fast_bf16_products", lambda: fast_bf16)
    operand_dtypes = []
    product = linear_module.dense_linear

    def spy(x, weight, bias, activation):
        operand_dtypes.append((x.dtype, weight.dtype, bias.dtype))
        return product(x, weight, bias, activation)

    monkeypatch.setattr(linear_module, "dense_linear", spy)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 40, 96, generator=gen).bfloat16()
    weight, bias = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((64, 96), (64,)))
    with torch.inference_mode():
        out = linear(x, weight, bias, "gelu")
        compiled = torch.compile(lambda t: linear(t, weight, bias, "gelu"), backend=CompileCounterWithBackend("eager"))
        compiled_out = compiled(x)
    wide = torch.float32 if not fast_bf16 else torch.bfloat16
    assert operand_dtypes == [(wide, wide, wide)] * 2 and out.dtype == compiled_out.dtype == torch.bfloat16
    exact = F.gelu(F.linear(x.double(), weight.double(), bias.double()))
    error = (out.double() - exact).abs().max().item()
    # One rounding to bf16 (half an ulp: 2^-9 of the value) where the product is fp32; bf16
    # products round their inputs' partial sums too.
    assert error <= exact.abs().max().item() * (2**-8 if not fast_bf16 else 2**-6), error
    torch.testing.assert_close(compiled_out, out, rtol=0, atol=0)


def test_linear_layers_keep_gradients_and_defer_to_other_layers() -> None:
    layer = Linear(6, 4)
    x = torch.randn(3, 6, requires_grad=True)
    linear(x, layer.weight, layer.bias, "gelu").sum().backward()  # the op has no backward: F.linear here
    assert x.grad is not None
    identity = torch.nn.Identity()  # e.g. a quantized layer: called, then GELU
    torch.testing.assert_close(linear_gelu(identity, x.detach()), F.gelu(x.detach()))
    linear_gelu(identity, x).sum().backward()  # with gradients wanted: F.gelu, which has a backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_after_another_layer_is_atens_as_one_op_when_compiled(dtype) -> None:
    """After a quantized layer the GELU is ATen's (`aten_gelu`), also in a compiled graph: the
    same values as F.gelu, and the compiled graph calls the op (which inductor leaves whole)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    x = torch.randn(4, 9, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    identity = torch.nn.Identity()
    expected = F.gelu(x)
    with torch.inference_mode():
        torch.testing.assert_close(linear_gelu(identity, x), expected, rtol=0, atol=0)
        backend = CompileCounterWithBackend("inductor")
        compiled = torch.compile(lambda t: linear_gelu(identity, t * 1.0), backend=backend, fullgraph=True)
        torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    ops = [node.target for graph in backend.graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.genfast.aten_gelu.default in ops


@pytest.mark.parametrize(("before", "after"), [(7, 256), (14, 64), (7, 7), (8, 5), (4, 32)])
def test_bicubic_matrices_resize_as_interpolate(before, after) -> None:
    table = torch.randn(3, before, before, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = F.interpolate(table[None], size=(after, after), mode="bicubic")[0]
    a = bicubic_matrix(before, after, torch.device("cpu")).double()
    torch.testing.assert_close(a @ table @ a.t(), expected, atol=1e-5, rtol=1e-5)  # fp32 weights


def test_position_embedding_is_the_resized_table_plus_the_tiled_window() -> None:
    """As the official trunk computes it: F.interpolate (bicubic) and a tiled window table."""
    trunk = build_random_sam2(tiny_sam2_config()).image_encoder.trunk
    h = w = 32
    window = trunk.pos_embed_window
    expected = F.interpolate(trunk.pos_embed, size=(h, w), mode="bicubic")
    expected = expected + window.tile(1, 1, h // window.shape[2], w // window.shape[3])
    torch.testing.assert_close(trunk.position_embedding(h, w), expected.permute(0, 2, 3, 1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("size", [(8, 8), (7, 9)])
def test_pool_is_max_pool2d(size) -> None:
    x = torch.randn(2, *size, 5)
    expected = F.max_pool2d(x.permute(0, 3, 1, 2), 2, 2).permute(0, 2, 3, 1)
    torch.testing.assert_close(_pool(x, 2), expected)


def test_sine_tables_of_given_sizes_are_made_once_as_buffers() -> None:
    encoding = PositionEmbeddingSine(32, sizes=((8, 8), (4, 6)))
    assert not encoding.state_dict()  # not part of checkpoints
    encoding.to(torch.bfloat16)
    for h, w in ((8, 8), (4, 6), (5, 5)):  # the last one computed (and cached) on demand
        x = torch.zeros(2, 3, h, w, dtype=torch.bfloat16)
        expected = encoding.table(h, w, x.device, torch.bfloat16)
        torch.testing.assert_close(encoding(x), expected.expand(2, -1, -1, -1), atol=0, rtol=0)


def test_blocks_in_pieces_give_the_whole_maps_values(monkeypatch) -> None:
    """The trunk's windowed attention, MLPs and widened shortcuts in pieces (sized by their largest
    intermediate's bytes, genfast.platform.heap): the values of one call, with pieces made in
    every block (a budget of a few hundred bytes instead of 16 MiB), and a pooling block's
    shortcut in strips of an odd map (its last row dropped, as max pooling does)."""
    from genfast.platform import heap
    from genfast.sam.sam2.modeling import hiera

    model = build_random_sam2(tiny_sam2_config(), seed=5)
    images = torch.randn(1, 3, 160, 160, generator=torch.Generator().manual_seed(5))  # 40 x 40 patches
    pooling = hiera.MultiScaleBlock(8, 16, 2, window=0, q_stride=2)
    odd_map = torch.randn(2, 9, 9, 8, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = [*model.image_encoder.trunk(images), pooling(odd_map)]
        pieces: list[tuple[int, int]] = []

        def recorded(fn, x, per_piece):
            pieces.append((x.shape[0], per_piece))
            return heap.in_pieces(fn, x, per_piece)

        monkeypatch.setattr(heap, "PIECE_BYTES", 512)
        monkeypatch.setattr(hiera, "in_pieces", recorded)
        in_pieces = [*model.image_encoder.trunk(images), pooling(odd_map)]
    assert in_pieces[-1].shape == (2, 4, 4, 16)
    with torch.no_grad():  # the strips against the plain widening then pooling
        torch.testing.assert_close(pooling._widened_shortcut(odd_map), _pool(pooling.proj(odd_map), 2))
    assert any(items > per_piece > 1 for items, per_piece in pieces), pieces
    for a, b in zip(in_pieces, whole, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
