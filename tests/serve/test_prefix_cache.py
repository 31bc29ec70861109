"""The prefix cache on its own: what it stores and restores is exactly what the rows held, its
keys are exact, its evictions take least recently used leaves and keep it within its budget.
(The engine's use of it, with greedy equality, is in test_engine.py.)"""

from __future__ import annotations

import pytest
import torch

from genfast.llm.model.layers import WindowKVCache
from genfast.llm.model.transformer import attention_mask
from genfast.serve.prefix_cache import PrefixCache
from tests.llm.hf_fixtures import tiny_genfast_model

BLOCK = 16


def prefill(model, row: int, tokens: list[int]) -> None:
    """Run `tokens` from position 0 into cache row `row`."""
    pos = torch.arange(len(tokens))
    with torch.inference_mode():
        model(torch.tensor([tokens]), pos, attention_mask(pos, len(tokens)), cache_rows=torch.tensor([row]))


def caches(model):
    return [layer.attention.kv_cache for layer in model.layers]


@pytest.mark.parametrize("name", ["llama3", "gemma2"])
def test_a_restored_row_holds_exactly_what_the_stored_row_held(name, tmp_path):
    """48 tokens prefilled into row 0, stored, restored into row 1: every full layer's keys and
    values of the 48 positions are equal bit for bit. Gemma 2's rings (window 6, 38 slots) held
    positions 10-47 when the blocks were stored, so block 0 has no ring keys; restoring 48
    positions needs only the window before position 48 (block 2's), and row 1's rings then hold
    exactly positions 42-47, with row 0's keys."""
    _, model = tiny_genfast_model(name, tmp_path)
    model.setup_caches(2, 128)
    tokens = [(7 * i) % 200 + 3 for i in range(48)]
    prefill(model, 0, tokens)
    rows = model.cache_rows()
    cache = PrefixCache(rows, 2**30, BLOCK)
    with torch.inference_mode():
        cache.store(0, tokens)
        prefix = cache.match(tokens + [1])
        assert prefix.length == 48 and len(prefix.blocks) == 3 and len(cache) == 3
        assert cache.restore(1, prefix, 0) == 48
    for c in caches(model):
        if isinstance(c, WindowKVCache):
            assert c.held_positions(1) == set(range(42, 48))
            assert torch.equal(c.read_span(1, 42, 48), c.read_span(0, 42, 48))
        else:
            assert torch.equal(c.read_span(1, 0, 48), c.read_span(0, 0, 48))
    if name == "gemma2":
        assert [block.ring is not None for block in prefix.blocks] == [False, True, True]
        assert cache.match(tokens[:17]).length == 0  # block 0 alone: no ring keys before position 16
    assert cache.nbytes == sum(block.nbytes for block in prefix.blocks)


def test_blocks_are_keyed_by_their_whole_prefix_and_a_last_block_may_match_in_part(tmp_path):
    _, model = tiny_genfast_model("llama3", tmp_path)
    model.setup_caches(1, 128)
    tokens = list(range(3, 51))  # three blocks
    prefill(model, 0, tokens)
    cache = PrefixCache(model.cache_rows(), 2**30, BLOCK)
    with torch.inference_mode():
        cache.store(0, tokens)
    assert cache.match(tokens).length == 47  # the last token always runs, for its logits
    assert cache.match(tokens + [9]).length == 48
    assert cache.match([99] + tokens[1:]).length == 0  # the same later blocks after another first one
    assert cache.match(tokens[:16] + [99] + tokens[17:]).length == 16
    partial = cache.match(tokens[:20] + [99, 98])  # the first 4 tokens of the second block
    assert partial.length == 20 and len(partial.blocks) == 2


def test_eviction_takes_the_least_recently_used_leaves_and_keeps_the_budget(tmp_path):
    """Budget: five blocks. A = a0 a1 a2; B = a0 b1 shares A's first block. Matching A makes b1
    the least recently used block, so C = c0 c1 evicts it. Then C grows a third block: the
    oldest blocks are now c1 and c0, which C's own store keeps, and a2 (A's leaf) goes, not
    a0 or a1, which have children."""
    _, model = tiny_genfast_model("llama3", tmp_path)
    model.setup_caches(1, 128)
    a = list(range(3, 51))
    b = a[:16] + list(range(100, 116))
    c = list(range(150, 182))
    cache = PrefixCache(model.cache_rows(), 0, BLOCK)
    with torch.inference_mode():
        for tokens in (a, b):
            prefill(model, 0, tokens)
            cache.budget = 2**30
            cache.store(0, tokens)
        one = cache.nbytes // len(cache)
        assert len(cache) == 4
        cache.budget = 5 * one
        assert cache.match(a + [1]).length == 48  # touch A
        prefill(model, 0, c)
        cache.store(0, c)
    assert cache.evicted == 1 and cache.nbytes <= cache.budget
    assert cache.match(b + [1]).length == 16 and cache.match(a + [1]).length == 48
    longer_c = c + list(range(200, 216))
    with torch.inference_mode():
        prefill(model, 0, longer_c)
        cache.store(0, longer_c)
    assert cache.evicted == 2 and len(cache) == 5
    assert cache.match(a + [1]).length == 32 and cache.match(longer_c + [1]).length == 48


def test_a_budget_smaller_than_a_block_stores_nothing(tmp_path):
    _, model = tiny_genfast_model("llama3", tmp_path)
    model.setup_caches(1, 128)
    tokens = list(range(3, 35))
    prefill(model, 0, tokens)
    cache = PrefixCache(model.cache_rows(), 100, BLOCK)
    with torch.inference_mode():
        cache.store(0, tokens)
    assert len(cache) == 0 and cache.nbytes == 0 and cache.match(tokens + [1]).length == 0
