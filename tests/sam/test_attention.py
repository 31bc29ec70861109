"""SAM's attention implementations: the fused native kernel against an fp32 reference, and the
math / sdpa / fused choices against each other on a whole encoder."""

from __future__ import annotations

import pytest
import torch

from genfast.kernels.rel_pos_attention import ops as kernels
from genfast.sam.build import build_sam
from genfast.sam.config import SamConfig
from genfast.sam.modeling.attention import rel_pos_attention, set_attention
from tests.sam.oracle import randomize_

# Head dim 32 (the kernel needs multiples of 16); 8x8 grid, 3x3 windows padded to 9x9.
FUSABLE = SamConfig(
    64,
    2,
    2,
    (1,),
    image_size=128,
    patch_size=16,
    window_size=3,
    prompt_embed_dim=32,
    mask_in_chans=8,
    decoder_mlp_dim=64,
    decoder_num_heads=2,
    iou_head_hidden_dim=32,
)

needs_kernel = pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=f"fused kernel unavailable: {kernels.unavailable_reason()}"
)


def _inputs(b: int, h: int, w: int, c: int, bias_scale: float = 1.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = h * w
    q, k, v = (torch.randn(b, 2, n, c, generator=gen) for _ in range(3))
    rel_h = torch.randn(b, 2, n, h, generator=gen) * bias_scale
    rel_w = torch.randn(b, 2, n, w, generator=gen) * bias_scale
    return q, k, v, rel_h, rel_w


@needs_kernel
@pytest.mark.parametrize(
    "b, h, w, c, bias_scale",
    [
        (3, 8, 8, 32, 1.0),  # N = 64: two query blocks
        (5, 3, 3, 16, 1.0),  # N = 9: keys padded to 16
        (2, 14, 14, 64, 1.0),  # SAM's windows: N = 196
        (1, 5, 7, 80, 1.0),  # vit_h's head dim, rectangular grid, N = 35
        (1, 6, 6, 48, 30.0),  # a bias that dominates the scores: the row max must be subtracted
        (1, 64, 64, 64, 1.0),  # SAM's global blocks: N = 4096
        (1, 65, 66, 16, 1.0),  # N = 4290: keys in chunks, grid rows across the chunks' ends
        (1, 55, 56, 96, 1.0),  # N = 3080: in chunks on AMX's tiles only (K past their one-pass bound)
    ],
)
def test_fused_kernel_matches_fp32_reference(b, h, w, c, bias_scale):
    """Tolerance: 1e-2 absolute on unit-variance values. The inputs are rounded to bf16 for both;
    the remaining error is P rounded to bf16 before P @ V (~2^-9 relative per term). With the
    products on fp32 FMAs (the AVX-512 variant on request, the AVX2 one always) P stays fp32: only
    the output's rounding to bf16 is left (2^-8 relative; 1e-3 absolute for the sums' order)."""
    q, k, v, rel_h, rel_w = (t.bfloat16() for t in _inputs(b, h, w, c, bias_scale))
    expected = rel_pos_attention(*(t.float() for t in (q, k, v, rel_h, rel_w)), impl="math")
    actual = rel_pos_attention(q, k, v, rel_h, rel_w, impl="fused")
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    assert (actual.float() - expected).abs().max().item() < 1e-2
    bf16 = kernels.rel_pos_attention(q, k, v, rel_h, rel_w, c**-0.5, fp32=False)
    assert (bf16.float() - expected).abs().max().item() < 1e-2
    fp32 = kernels.rel_pos_attention(q, k, v, rel_h, rel_w, c**-0.5, fp32=True)
    torch.testing.assert_close(fp32.float(), expected, atol=1e-3, rtol=2**-8)


@needs_kernel
@pytest.mark.parametrize("b, h, w, c", [(3, 8, 8, 32), (5, 3, 3, 16), (2, 14, 14, 64), (1, 5, 7, 80), (1, 64, 64, 64)])
def test_fused_kernel_in_fp32_matches_math(b, h, w, c):
    """Where the loaded variant computes in fp32 (AVX2), fp32 inputs take the kernel, and it agrees
    with the explicit softmax to fp32 rounding (1e-5: sums of up to 4096 terms in another order)."""
    if not kernels.takes(torch.float32):
        pytest.skip(f"the {kernels.loaded_isa()} variant takes bf16 only")
    q, k, v, rel_h, rel_w = _inputs(b, h, w, c)
    assert kernels.supports(q)
    expected = rel_pos_attention(q, k, v, rel_h, rel_w, impl="math")
    actual = rel_pos_attention(q, k, v, rel_h, rel_w, impl="fused")
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_fused_kernel_rejects_mixed_dtypes():
    q, k, v, rel_h, rel_w = _inputs(1, 3, 3, 16)
    with pytest.raises(RuntimeError, match="rel_pos_attention"):
        torch.ops.genfast.rel_pos_attention(q.bfloat16(), k, v, rel_h, rel_w, 0.25)


def test_sdpa_matches_math_in_fp32():
    q, k, v, rel_h, rel_w = _inputs(2, 5, 7, 8)
    torch.testing.assert_close(
        rel_pos_attention(q, k, v, rel_h, rel_w, "sdpa"),
        rel_pos_attention(q, k, v, rel_h, rel_w, "math"),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize(
    "b, h, w, c, bias_scale",
    [
        (2, 5, 7, 8, 1.0),  # rectangular grid; C + H + W = 20, padded to 24
        (3, 3, 3, 16, 30.0),  # a bias that dominates the scores
        (1, 14, 14, 64, 1.0),  # SAM's windows: 92 dimensions, padded to 96
        (1, 5, 7, 80, 1.0),  # vit_h's head dim: its scale is not a power of two
    ],
)
def test_folded_bias_matches_math(b, h, w, c, bias_scale):
    """The bias folded into the scores' product: fp32 agrees with the explicit softmax to fp32
    rounding; bf16 is within the fused kernel's 1e-2 of the fp32 reference."""
    inputs = _inputs(b, h, w, c, bias_scale)
    torch.testing.assert_close(
        rel_pos_attention(*inputs, "folded"), rel_pos_attention(*inputs, "math"), rtol=1e-5, atol=1e-5
    )
    low = [t.bfloat16() for t in inputs]
    expected = rel_pos_attention(*(t.float() for t in low), "math")
    actual = rel_pos_attention(*low, "folded")
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    assert (actual.float() - expected).abs().max().item() < 1e-2


def test_fused_falls_back_to_sdpa_where_the_kernel_does_not_apply():
    q, k, v, rel_h, rel_w = _inputs(2, 5, 7, 8)  # fp32, head dim 8
    torch.testing.assert_close(
        rel_pos_attention(q, k, v, rel_h, rel_w, "fused"),
        rel_pos_attention(q, k, v, rel_h, rel_w, "sdpa"),
        rtol=0,
        atol=0,
    )


def _embeddings(model, image: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    set_attention(model, impl)
    with torch.inference_mode():
        return model.to(dtype).image_encoder(image.to(dtype)).float()


@needs_kernel
def test_sam2_attention_choices_agree():
    """fp32: sdpa and folded == math to 1e-5. bf16 with the fused kernel or the folded bias: as
    close to fp32 as bf16 SDPA is (error at most 1.5x SDPA's, and cosine >= 0.999)."""
    torch.manual_seed(0)
    model = build_sam(FUSABLE)
    randomize_(model)
    image = torch.randn(2, 3, 128, 128)
    reference = _embeddings(model, image, "math", torch.float32)
    torch.testing.assert_close(_embeddings(model, image, "sdpa", torch.float32), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_embeddings(model, image, "folded", torch.float32), reference, rtol=1e-5, atol=1e-5)
    sdpa = _embeddings(model, image, "sdpa", torch.bfloat16)
    sdpa_err = (sdpa - reference).abs().max().item()
    for impl in ("fused", "folded"):
        low = _embeddings(model, image, impl, torch.bfloat16)
        assert (low - reference).abs().max().item() <= 1.5 * sdpa_err, impl
        assert torch.nn.functional.cosine_similarity(low.flatten(), reference.flatten(), dim=0) >= 0.999, impl


def test_unknown_attention_impl_is_rejected():
    with pytest.raises(ValueError, match="unknown attention implementation"):
        set_attention(build_sam(FUSABLE), "flash")


@pytest.mark.parametrize("h, w", [(5, 7), (14, 14)])  # sequence lengths 35 and 196: not multiples of any tile
def test_flex_attention_path_matches_math(h, w):
    """The CUDA path's math, run on the CPU (eagerly and compiled)."""
    from genfast.sam.modeling.attention import flex_rel_pos_attention

    q, k, v, rel_h, rel_w = _inputs(2, h, w, 16)
    expected = rel_pos_attention(q, k, v, rel_h, rel_w, "math")
    torch.testing.assert_close(flex_rel_pos_attention(q, k, v, rel_h, rel_w), expected, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_fused_kernel_reads_strided_qkv_views():
    """q, k, v as the encoder makes them: views into one [B, N, 3, heads, C] projection output."""
    gen = torch.Generator().manual_seed(1)
    b, heads, h, w, c = 2, 3, 6, 5, 32
    qkv = torch.randn(b, h * w, 3, heads, c, generator=gen).bfloat16()
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    rel_h = torch.randn(b, heads, h * w, h, generator=gen).bfloat16()
    rel_w = torch.randn(b, heads, h * w, w, generator=gen).bfloat16()
    expected = rel_pos_attention(*(t.float() for t in (q, k, v, rel_h, rel_w)), impl="math")
    actual = rel_pos_attention(q, k, v, rel_h, rel_w, impl="fused")
    assert not q.is_contiguous() and actual.shape == expected.shape
    assert (actual.float() - expected).abs().max().item() < 1e-2


@pytest.mark.parametrize("broadcast", ["none", "keys", "queries"])
def test_decoder_attention_on_the_kernel_broadcasts_a_shared_image(broadcast: str, monkeypatch):
    """The mask decoder's attention ("fused"): a batch of prompts against one image's tokens (keys
    or queries with batch 1, as the automatic generator's first layer passes them) gives SDPA's
    broadcast result, through the native kernel where it takes bf16 and beats SDPA (AVX-512: always;
    AVX2: fp32 only, so bf16 there is SDPA's own)."""
    from genfast.sam.modeling.attention import attention

    gen = torch.Generator().manual_seed(0)
    tokens, image = 8, 4096
    prompts = {"none": (3, 3), "keys": (3, 1), "queries": (1, 3)}[broadcast]
    q_len, k_len = (tokens, image) if broadcast != "queries" else (image, tokens)
    q = torch.randn(prompts[0], 8, q_len, 16, generator=gen).bfloat16()
    k, v = (torch.randn(prompts[1], 8, k_len, 16, generator=gen).bfloat16() for _ in range(2))
    calls = []
    kernel_attention = kernels.attention
    monkeypatch.setattr(kernels, "attention", lambda *args: calls.append(args) or kernel_attention(*args))
    actual = attention(q, k, v, "fused").float()
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert actual.shape == expected.shape == (3, 8, q_len, 16)
    assert (actual - expected).norm() / expected.norm() < 1e-2
    runs_kernel = kernels.supports(q) and kernels.attention_pays(q_len, k_len, 16)
    assert len(calls) == runs_kernel


def test_the_avx2_kernel_is_left_to_sdpa_for_a_few_queries(monkeypatch):
    """The AVX2 variant loses to SDPA with a handful of query rows (the decoder's prompt tokens
    against 4096 image tokens: ~8x slower, notes.md), so it is not chosen there; with 4096 queries
    (Hiera's global blocks) it is."""
    monkeypatch.setattr(kernels, "loaded_isa", lambda: "avx2")
    assert not kernels.attention_pays(8, 4096, 16)
    assert kernels.attention_pays(4096, 4096, 96)
