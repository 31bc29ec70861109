"""The native decode attention kernel against a float64 reference, its bitwise invariance to what
else shares a call, and the layer that uses it. (An AVX-512 run also runs this file under the AVX2
cap, which loads the other variant: tests/kernels/test_registry.py.)"""

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
    """The tasks follow the thread count; the result must be the same attention (and bitwise the
    same: test_outputs_are_invariant_to_what_shares_the_call)."""
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
    rows = torch.ones(1, 1, 3, 10, dtype=torch.bool)  # 3 mask rows for 2 queries
    with pytest.raises(RuntimeError, match="mask must be bool"):
        decode_attention.decode_attention(torch.randn(1, 4, 2, 64), k[:, :2], k[:, :2], rows, 0.125)


def test_applies_to_single_query_steps_only():
    q, keys = torch.randn(2, 4, 5, 64), torch.randn(2, 2, 10, 64)
    causal = attention_mask(torch.arange(5, 10), 10)  # [1, 1, 5, 10]
    available = DECODE_ATTENTION.available()
    assert not decode_attention.applies(q, keys, causal)  # a prefill: SDPA's
    assert decode_attention.applies(q[:, :, :1], keys, causal[:, :, -1:]) == available
    assert not decode_attention.applies(q[:, :, :1], keys, causal[:, :, -1:, :9])  # a mask column per key
    assert not decode_attention.applies(q[:, :, :1], keys, causal[:, :, -1:].float())  # an additive mask


@native
@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (5, 1, 32), (14, 2, 96), (12, 2, 16)])
@pytest.mark.parametrize("queries,keys", [(3, 3), (17, 70), (130, 130)])
def test_several_causal_queries_match_float64(q_dtype, cache_dtype, heads, kv_heads, head_dim, queries, keys):
    """Prefill (S = L) and a chunk of prefill after cached keys (S < L): each query position has a
    causal mask row of its own; one sequence is left-padded."""
    torch.manual_seed(0)
    batch = 2
    q = torch.randn(batch, heads, queries, head_dim).to(q_dtype)
    cache = torch.randn(2, batch, kv_heads, keys + 40, head_dim).to(cache_dtype) * 2
    k, v = cache[0, :, :, :keys], cache[1, :, :, :keys]
    mask = attention_mask(torch.arange(keys - queries, keys), keys, pad_start=torch.tensor([0, keys // 3]))
    scale = head_dim**-0.5
    out = decode_attention.decode_attention(q, k, v, mask, scale)
    assert out.dtype == q_dtype and out.shape == q.shape
    budget = 2e-6 if q_dtype == torch.float32 else 8e-3
    assert relative_error(out, reference(q, k, v, mask, scale)) < budget
    shared = mask[:1, :, -1:]  # one mask row for every query of every sequence
    out = decode_attention.decode_attention(q, k, v, shared, scale)
    assert relative_error(out, reference(q, k, v, shared, scale)) < budget


def with_threads(threads: int, fn, *args):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return fn(*args)
    finally:
        torch.set_num_threads(before)


INVARIANCE_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                     (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]  # fmt: skip


@native
@pytest.mark.parametrize("q_dtype,cache_dtype", INVARIANCE_DTYPES)
def test_outputs_are_invariant_to_what_shares_the_call(q_dtype: torch.dtype, cache_dtype: torch.dtype):
    """Every query's output, bitwise, whatever shares its call: the same query alone (one sequence,
    one position, only the keys it may see) against it in batches, beside other sequences and
    positions, over extra masked keys of any content, in prefills whole and in chunks (a prefix
    cache), and on 1, 2 or 3 threads. Key counts straddle the kernel's chunks of keys; the calls'
    sizes take both of its schemes (split-K for few query rows, a task per row for many)."""
    attend = decode_attention.decode_attention
    heads, kv_heads, d, scale = 6, 2, 64, 0.125
    for keys in (1, 63, 64, 65, 200):
        torch.manual_seed(keys)
        queries = min(7, keys)
        q = torch.randn(3, heads, queries, d).to(q_dtype)
        k, v = (torch.randn(3, kv_heads, keys, d).to(cache_dtype) for _ in range(2))
        mask = attention_mask(torch.arange(keys - queries, keys), keys).expand(3, 1, queries, keys).clone()
        mask &= torch.rand(mask.shape) > 0.3  # holes, a whole chunk of them for some rows
        mask[..., : keys // 2] &= torch.rand(3, 1, queries, 1) > 0.3
        mask[1, :, :, :] = torch.arange(keys) >= keys - 2  # left padding
        mask[2, :, 0] = False  # a query with no visible key: zeros
        # Each query alone, over the keys up to its last visible one (the end of a shorter cache).
        alone = torch.empty(3, heads, queries, d, dtype=q_dtype)
        for b in range(3):
            for s in range(queries):
                row = mask[b : b + 1, :, s : s + 1]
                last = int(row.nonzero()[:, -1].max()) + 1 if row.any() else 1
                alone[b, :, s : s + 1] = attend(q[b : b + 1, :, s : s + 1], k[b : b + 1, :, :last],
                                                v[b : b + 1, :, :last], row[..., :last], scale)  # fmt: skip
        assert torch.equal(alone[2, :, 0], torch.zeros_like(alone[2, :, 0]))
        for threads in (1, 2, 3):
            assert torch.equal(with_threads(threads, attend, q, k, v, mask, scale), alone)
            for s in range(queries):  # S = 1 calls of the whole batch
                one = with_threads(threads, attend, q[:, :, s : s + 1], k, v, mask[:, :, s : s + 1], scale)
                assert torch.equal(one, alone[:, :, s : s + 1])
        # 37 more keys of random content, masked: the cache's unwritten tail.
        k_long, v_long = (torch.cat([t, torch.randn(3, kv_heads, 37, d).to(cache_dtype) * 9], dim=2) for t in (k, v))
        mask_long = torch.cat([mask, torch.zeros(3, 1, queries, 37, dtype=torch.bool)], dim=-1)
        assert torch.equal(attend(q, k_long, v_long, mask_long, scale), alone)
        # Among 40 sequences (a task per query row), ours at rows 5, 17 and 39.
        big_q = torch.randn(40, heads, queries, d).to(q_dtype)
        big_k, big_v = (torch.randn(40, kv_heads, keys, d).to(cache_dtype) for _ in range(2))
        big_mask = torch.rand(40, 1, queries, keys) > 0.5
        places = [5, 17, 39]
        big_q[places], big_k[places], big_v[places], big_mask[places] = q, k, v, mask
        for threads in (1, 2, 3):
            assert torch.equal(with_threads(threads, attend, big_q, big_k, big_v, big_mask, scale)[places], alone)
    # A causal prefill of 200 positions whole (a task per row), in two chunks (the second over the
    # first's cached keys), and position by position as decode (split-K).
    torch.manual_seed(1)
    keys = 200
    q = torch.randn(1, heads, keys, d).to(q_dtype)
    k, v = (torch.randn(1, kv_heads, keys, d).to(cache_dtype) for _ in range(2))
    causal = attention_mask(torch.arange(keys), keys)
    whole = attend(q, k, v, causal, scale)
    first = attend(q[:, :, :90], k[:, :, :90], v[:, :, :90], causal[:, :, :90, :90], scale)
    second = attend(q[:, :, 90:], k, v, causal[:, :, 90:], scale)
    assert torch.equal(torch.cat([first, second], dim=2), whole)
    for s in (0, 62, 63, 64, 65, 127, 128, 199):
        step = attend(q[:, :, s : s + 1], k[:, :, : s + 1], v[:, :, : s + 1], causal[:, :, s : s + 1, : s + 1], scale)
        assert torch.equal(step, whole[:, :, s : s + 1])
    for threads in (1, 2, 3):
        assert torch.equal(with_threads(threads, attend, q, k, v, causal, scale), whole)


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
