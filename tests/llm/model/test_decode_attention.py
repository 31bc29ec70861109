"""The native decode attention kernel against a float64 reference, and the layer that uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genfast.kernels.decode_attention import ops as decode_attention
from genfast.kernels.decode_attention.ops import KERNEL as DECODE_ATTENTION
from genfast.llm.model.config import ModelArgs
from genfast.llm.model.layers import Attention, KVCache
from genfast.llm.model.transformer import attention_mask

native = pytest.mark.skipif(not DECODE_ATTENTION.available(), reason=str(DECODE_ATTENTION.unavailable_reason()))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return probs @ v


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected).abs().max() / expected.abs().max()).item()


@native
@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (5, 1, 32), (14, 2, 96), (12, 2, 16)])
@pytest.mark.parametrize("keys", [1, 7, 33, 517])
def test_matches_float64_over_a_strided_cache(q_dtype, cache_dtype, heads, kv_heads, head_dim, keys):
    """Groups of 3, 1, 5 (4 + 1), 7 (4 + 3) and 6 (4 + 2) queries per KV head; key counts below a
    vector, between chunks and over many; keys and values are slices of a longer cache."""
    torch.manual_seed(0)
    batch = 2
    q = torch.randn(batch, heads, 1, head_dim).to(q_dtype)
    cache = torch.randn(2, batch, kv_heads, keys + 40, head_dim).to(cache_dtype) * 2
    k, v = cache[0, :, :, :keys], cache[1, :, :, :keys]
    mask = torch.rand(batch, 1, 1, keys) > 0.3
    mask[..., -1] = True  # the current token is always visible
    scale = head_dim**-0.5
    out = decode_attention.decode_attention(q, k, v, mask, scale)
    assert out.dtype == q_dtype and out.shape == q.shape
    # fp32 throughout: the error is the inputs' rounding to the output dtype (bf16: 2^-8).
    budget = 2e-6 if q_dtype == torch.float32 else 8e-3
    assert relative_error(out, reference(q, k, v, mask, scale)) < budget


@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16)])  # fmt: skip
def test_the_portable_path_matches_float64(q_dtype, cache_dtype):
    """The PyTorch path compiled decode takes where no variant runs: the same attention."""
    torch.manual_seed(0)
    q = torch.randn(2, 6, 1, 24).to(q_dtype)  # a head size the kernel does not take
    k, v = (torch.randn(2, 2, 37, 24).to(cache_dtype) for _ in range(2))
    mask = torch.rand(2, 1, 1, 37) > 0.3
    mask[..., -1] = True
    out = decode_attention.portable(q, k, v, mask, 0.2)
    assert out.dtype == q_dtype and out.shape == q.shape
    assert relative_error(out, reference(q, k, v, mask, 0.2)) < (2e-6 if q_dtype == torch.float32 else 8e-3)


@native
def test_a_shared_mask_a_masked_chunk_and_a_fully_masked_row():
    """A [1, 1, 1, L] mask serves every sequence; left padding masks whole chunks of keys; a
    sequence with no visible key gets zeros, not NaN."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 1, 64), torch.randn(3, 2, 300, 64), torch.randn(3, 2, 300, 64)
    shared = torch.zeros(1, 1, 1, 300, dtype=torch.bool)
    shared[..., 250:] = True
    out = decode_attention.decode_attention(q, k, v, shared, 0.125)
    assert relative_error(out, reference(q, k, v, shared, 0.125)) < 2e-6
    per_row = shared.expand(3, 1, 1, 300).clone()
    per_row[2] = False
    out = decode_attention.decode_attention(q, k, v, per_row, 0.125)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert relative_error(out[:2], reference(q[:2], k[:2], v[:2], per_row[:2], 0.125)) < 2e-6


@native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_result_does_not_depend_much_on_the_thread_count(threads):
    """The chunks follow the thread count; their combination must give the same attention."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 6, 1, 64), torch.randn(1, 2, 1000, 64), torch.randn(1, 2, 1000, 64)
    mask = torch.ones(1, 1, 1, 1000, dtype=torch.bool)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = decode_attention.decode_attention(q, k, v, mask, 0.125)
    finally:
        torch.set_num_threads(before)
    assert relative_error(out, reference(q, k, v, mask, 0.125)) < 2e-6


@native
def test_bad_shapes_are_refused():
    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 3, 10, 64)
    mask = torch.ones(1, 1, 1, 10, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        decode_attention.decode_attention(q, k, k, mask, 0.125)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        decode_attention.decode_attention(q, k[:, :2], k[:, :2], mask[..., :5], 0.125)


@pytest.mark.parametrize("compiled", [False, True])
def test_attention_layer_decode_matches_sdpa(compiled):
    """One decode step of the shared Attention layer over a bf16 cache, eager and compiled: the
    kernel where this CPU has it, else the fallbacks (SDPA eagerly, multiply-sums compiled)."""
    torch.manual_seed(0)
    args = ModelArgs(dim=192, n_layers=1, n_heads=6, n_kv_heads=2, vocab_size=32, intermediate_size=64, max_seq_len=64)
    attention = Attention(args)
    attention.kv_cache = KVCache(1, 64, args.n_kv_heads, args.head_dim, torch.bfloat16)
    torch.nn.init.normal_(attention.kv_cache.k)
    torch.nn.init.normal_(attention.kv_cache.v)
    q, input_pos = torch.randn(1, 6, 1, args.head_dim), torch.tensor([40])
    mask = attention_mask(input_pos, 41)
    keys, values = attention.kv_cache.read(41)
    assert decode_attention.applies(q, keys, mask) == DECODE_ATTENTION.available()
    attend = torch.compile(attention.attend, fullgraph=True, dynamic=False) if compiled else attention.attend
    out = attend(q, keys, values, mask, input_pos)
    expected = F.scaled_dot_product_attention(q, keys.float(), values.float(), attn_mask=mask, enable_gqa=True)
    assert (out - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("name, builds", [("smollm", True), ("qwen3", False)])  # head sizes 16 and 24
def test_a_cpu_load_builds_the_kernel_only_for_heads_it_takes(name, builds, tmp_path, monkeypatch):
    from genfast.llm.loading import load
    from tests.llm.hf_fixtures import make_hf_model, save_hf_model, word_tokenizer

    hf = make_hf_model(name)
    directory = save_hf_model(hf, tmp_path / name)
    word_tokenizer(hf.config.vocab_size).save(directory)
    asked = []
    monkeypatch.setattr(decode_attention, "kernel_available", lambda: asked.append(1) or True)
    loaded = load(str(directory), "cpu", "float32")
    assert loaded.model.args.head_dim % decode_attention.HEAD_DIM_MULTIPLE == (0 if builds else 8)
    assert asked == ([1] if builds else [])
