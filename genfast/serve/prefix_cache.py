"""Prefix caching across requests and slots: blocks of prompt keys and values, kept under a budget.

Each of the engine's slots keeps its last request's keys and values in its cache row (row reuse,
genfast/serve/engine.py), which helps the next request that lands in that same row. This cache
goes further: it keeps the keys and values of every layer for blocks of `block_size` tokens,
each block keyed by its tokens and by the block before it (a tree of blocks: vLLM's block
hashing, with exact keys instead of hashes, so two prefixes can never be mistaken for each
other). A new request finds the longest run of leading blocks that any earlier request computed,
in whichever slot, including requests that are still running, plus the leading tokens it shares
with one more stored block (a system prompt rarely ends on a block boundary), and copies them
into its own row instead of prefilling them.

Blocks are copied in, not shared in place: a slot's row stays one contiguous buffer, so
attention and the compiled graphs do not change. The price is memory (a block lives here and in
every row that uses it) and one copy of the prefix's keys and values, which costs milliseconds
where prefilling the same tokens costs seconds.

The memory budget is `budget_bytes`. When a new block does not fit, the least recently used
blocks are evicted. Matching or storing a prefix touches its blocks from the last to the first,
so a block is always more recent than the blocks after it. The least recently used block is
therefore a leaf, and eviction never strands a block whose parent is gone.

Sliding-window layers keep a ring of their latest positions (genfast/llm/model/layers.py). A block
stores their keys and values only if the ring still held them when the block was stored, for
example right after a prefill chunk. Only a prefix whose last `window` positions have them can be
restored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from genfast.llm.decoding.generate import common_prefix
from genfast.llm.model.layers import CacheRows, KVCache, WindowKVCache

BLOCK_SIZE = 16  # tokens per block: a prompt reuses whole blocks and prefills the rest


@dataclass(eq=False)  # compared and hashed by identity: a block is part of its children's keys
class Block:
    key: tuple[Block | None, tuple[int, ...]]  # the block before it, and its tokens
    full: Tensor  # keys and values of the full-cache layers: [layers, 2, kv_heads, block_size, head_dim]
    ring: Tensor | None = None  # the same for the sliding-window layers, where stored
    children: set[Block] = field(default_factory=set)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.key[1]

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + (0 if self.ring is None else self.ring.nbytes)


@dataclass
class Prefix:
    """Stored blocks whose tokens begin a prompt: the first `length` of their tokens match (all of
    every block but the last, which may match in part)."""

    blocks: list[Block]
    length: int


class PrefixCache:
    """KV blocks of token prefixes under a memory budget (see the module doc)."""

    def __init__(self, rows: CacheRows, budget_bytes: int, block_size: int = BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.rows, self.budget, self.block_size = rows, budget_bytes, block_size
        self._blocks: OrderedDict[tuple[Block | None, tuple[int, ...]], Block] = OrderedDict()
        self._roots: set[Block] = set()  # the blocks that begin a sequence
        self.nbytes = 0
        self.evicted = 0  # blocks evicted to make room, since the start

    def __len__(self) -> int:
        return len(self._blocks)

    def _blocks_of(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        b = self.block_size
        return [tuple(tokens[i : i + b]) for i in range(0, len(tokens) - b + 1, b)]

    def match(self, prompt: Sequence[int]) -> Prefix:
        """The longest stored prefix of `prompt` that can be restored: whole blocks, then the part
        of one more block (the child of the last whole one sharing the most leading tokens with the
        rest of the prompt). The prompt's last token is left out: it always runs, for its logits."""
        b, limit = self.block_size, len(prompt) - 1
        blocks: list[Block] = []
        for tokens in self._blocks_of(prompt[:limit]):
            block = self._blocks.get((blocks[-1] if blocks else None, tokens))
            if block is None:
                break
            blocks.append(block)
        length = len(blocks) * b
        rest = prompt[length:limit]
        if rest:
            candidates = blocks[-1].children if blocks else self._roots
            best = max(candidates, key=lambda block: common_prefix(block.tokens, rest), default=None)
            if best is not None and (n := common_prefix(best.tokens, rest)):
                blocks.append(best)
                length += n
        while blocks and not self._rings_stored(blocks, length):
            blocks.pop()
            length = len(blocks) * b
        self._touch(blocks)
        return Prefix(blocks, length)

    def _rings_stored(self, blocks: list[Block], length: int) -> bool:
        """Whether the blocks covering the window before position `length` have ring keys."""
        if not self.rows.rings:
            return True
        first = max(0, length - self.rows.window) // self.block_size
        return all(block.ring is not None for block in blocks[first:])

    def restore(self, row: int, prefix: Prefix, start: int) -> int:
        """Copy `prefix` (match's) into cache row `row`, from position `start` on (the positions
        before it hold the same keys already); return the prefix length it fills."""
        end, b = prefix.length, self.block_size
        first = start // b
        if start < end:
            kv = torch.cat([block.full for block in prefix.blocks[first:]], dim=3)[:, :, :, : end - first * b]
            for cache, layer_kv in zip(self.rows.full, kv, strict=True):
                cache.write_span(row, first * b, layer_kv)
        if self.rows.rings:
            ring_start = max(0, end - self.rows.window)
            first = ring_start // b
            kv = torch.cat([block.ring for block in prefix.blocks[first:]], dim=3)  # type: ignore[misc]
            kv = kv[:, :, :, ring_start - first * b : end - first * b]
            for cache, layer_kv in zip(self.rows.rings, kv, strict=True):
                cache.write_span(row, ring_start, layer_kv)
        return end

    def store(self, row: int, tokens: Sequence[int]) -> None:
        """Keep the whole blocks of `tokens`, whose keys and values fill positions 0.. of cache row
        `row`, as far as the budget allows; blocks stored already are only touched."""
        chain: list[Block] = []
        b = self.block_size
        ring_held = self.rows.ring_positions(row)
        for i, tokens_i in enumerate(self._blocks_of(tokens)):
            parent = chain[-1] if chain else None
            block = self._blocks.get((parent, tokens_i))
            start, end = i * b, (i + 1) * b
            if block is None:
                full = self._read(self.rows.full, row, start, end)
                if not self._make_room(full.nbytes, chain):
                    break
                block = Block((parent, tokens_i), full)
                self._blocks[block.key] = block
                self.nbytes += block.nbytes
                (parent.children if parent is not None else self._roots).add(block)
            if block.ring is None and ring_held is not None and all(p in ring_held for p in range(start, end)):
                ring = self._read(self.rows.rings, row, start, end)
                if self._make_room(ring.nbytes, [*chain, block]):
                    block.ring = ring
                    self.nbytes += ring.nbytes
            chain.append(block)
        self._touch(chain)

    @staticmethod
    def _read(caches: Sequence[KVCache | WindowKVCache], row: int, start: int, end: int) -> Tensor:
        return torch.stack([cache.read_span(row, start, end) for cache in caches])

    def _make_room(self, nbytes: int, keep: list[Block]) -> bool:
        """Evict least recently used leaves (not those in `keep`) until `nbytes` more fit."""
        kept = set(keep)
        while self.nbytes + nbytes > self.budget:
            victim = next((b for b in self._blocks.values() if not b.children and b not in kept), None)
            if victim is None:
                return False
            del self._blocks[victim.key]
            parent = victim.key[0]
            (parent.children if parent is not None else self._roots).discard(victim)
            self.nbytes -= victim.nbytes
            self.evicted += 1
        return True

    def _touch(self, blocks: list[Block]) -> None:
        for block in reversed(blocks):  # the first block ends up the most recent
            self._blocks.move_to_end(block.key)
