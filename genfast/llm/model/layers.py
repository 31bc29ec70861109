"""The blocks every Llama-style decoder family shares: RMSNorm, the static KV cache, rotary
embedding, attention over the cache, the gated MLP and the pre-norm block. A family (genfast/llm/
families/) reuses them and overrides only what differs (e.g. Qwen3's per-head q/k norms).

Layout choices, all for decode speed:
- q/k/v are one fused projection and gate/up another, so a layer runs four matmuls, not seven.
- The KV cache is a fixed buffer per layer; attention reads only its valid prefix, whose length
  is the attention mask's last dimension. Compiled with that dimension dynamic, one graph
  serves every length. One query per sequence (decode) attends through a native kernel on CPUs
  with one (genfast/kernels/decode_attention/), eager or compiled.
- Rotary embeddings use the Hugging Face (rotate-half) layout, so HF weights load unpermuted.

Every cache (KVCache, WindowKVCache, and DeepSeek's LatentKVCache) offers the same small interface
to the code around the model: an attention's `new_cache` makes it; `dtype`, `slot_bytes` (one
position of one row) and `slots_read` (positions a decode step reads) size it for the stats;
`read_span`/`write_span` (positions on dim 2) copy rows for the serve engine's prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.kernels.decode_attention import ops as decode_attention
from genfast.llm.model.moe import MoEFeedForward
from genfast.nn import Linear

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalize in fp32 and scale in the input dtype, the order HF uses (bf16 agreement).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


# A sliding-window layer's ring holds this many slots beyond its window: a speculative
# verification writes up to MAX_K + 1 tokens that may be rejected, and those writes must not
# overwrite keys that are still inside the window of the next accepted position.
WINDOW_SLACK = 32


def window_mask(mask: Tensor, input_pos: Tensor, window: int) -> Tensor:
    """`mask` [B|1, 1, S, L] over slots that are positions, with keys at or before query position
    - window masked out."""
    key_pos = torch.arange(mask.shape[-1], device=mask.device)[None, None, None, :]
    query_pos = input_pos.reshape(-1, 1, input_pos.shape[-1], 1)
    return mask & (key_pos > query_pos - window)


class KVCache(nn.Module):
    """Static per-layer key/value buffers of shape [batch, kv_heads, max_len, head_dim], slot =
    position; `window`: the layer attends only to that many latest positions (masked here)."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.window = window
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def attend_inputs(
        self, input_pos: Tensor, k: Tensor, v: Tensor, mask: Tensor, rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Store this call's k/v and return the keys, values (in the cache's dtype, which may be
        narrower than the model's: `Transformer.cache_dtype`) and mask its queries attend over."""
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        self.update(input_pos, k, v, rows)
        keys, values = self.read(mask.shape[-1], rows)
        return keys, values, mask if self.window is None else window_mask(mask, input_pos, self.window)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, rows: Tensor | None = None) -> None:
        """Write k/v [B, kv_heads, S, D] at slots input_pos (see `write_slots`)."""
        write_slots(self.k, input_pos, k, rows)
        write_slots(self.v, input_pos, v, rows)

    def read(self, kv_len: int, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values of the first kv_len slots, of all rows or of `rows` [B] (a copy)."""
        if rows is None:
            return self.k[:, :, :kv_len], self.v[:, :, :kv_len]
        return self.k[rows, :, :kv_len], self.v[rows, :, :kv_len]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def slot_bytes(self) -> int:
        """Bytes one position of one row holds."""
        return 2 * self.k.shape[1] * self.k.shape[3] * self.k.element_size()

    def slots_read(self, kv_len: float) -> float:
        """How many positions of a row a decode step at cache length `kv_len` reads."""
        return kv_len

    def read_span(self, row: int, start: int, end: int) -> Tensor:
        """Keys and values of positions start..end-1 of cache row `row`: [2, kv_heads, end - start, head_dim]."""
        return torch.stack([self.k[row, :, start:end], self.v[row, :, start:end]])

    def write_span(self, row: int, start: int, kv: Tensor) -> None:
        """Put keys and values [2, kv_heads, n, head_dim] (read_span's) at positions start.. of row `row`."""
        end = start + kv.shape[2]
        self.k[row, :, start:end] = kv[0]
        self.v[row, :, start:end] = kv[1]


def write_slots(buffer: Tensor, input_pos: Tensor, x: Tensor, rows: Tensor | None = None) -> None:
    """Write x [B, heads, S, D] into `buffer` [rows, heads, slots, D] at slots input_pos: [S]
    shared by all rows, or [B, S] per row (continuous batching, where each sequence is at its own
    length). rows: [B], the cache rows the batch rows write (default: all, in order)."""
    if input_pos.dim() == 1 and rows is None:
        buffer.index_copy_(2, input_pos, x)
        return
    if rows is None:
        rows = torch.arange(x.shape[0], device=x.device)
    pos = input_pos.expand(x.shape[0], x.shape[2])
    # Advanced indices on dims 0 and 2 put the indexed dims first: the target is [B, S, H, D].
    buffer[rows[:, None], :, pos] = x.transpose(1, 2)


class LatentKVCache(nn.Module):
    """The cache of multi-head latent attention (DeepSeek's MLA, genfast/llm/model/families/
    deepseek.py): per position one vector of `width` shared by all heads (the normalized latent,
    then the rotated shared key), in a buffer [batch, 1, max_len, width], slot = position. Its
    spans have KVCache's layout (positions on dim 2) with one part and one head, so the serve
    engine's prefix cache treats it like a full cache."""

    def __init__(
        self, batch: int, max_len: int, width: int, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        latent = torch.zeros(batch, 1, max_len, width, dtype=dtype, device=device)
        self.register_buffer("latent", latent, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.latent.dtype

    @property
    def slot_bytes(self) -> int:
        return self.latent.shape[3] * self.latent.element_size()

    def slots_read(self, kv_len: float) -> float:
        return kv_len

    def attend_inputs(self, input_pos: Tensor, latent: Tensor, rows: Tensor | None, kv_len: int) -> Tensor:
        """Store this call's latents [B, 1, S, width] and return the first kv_len slots' [B, 1, kv_len, width]
        (of all rows, or of `rows`)."""
        write_slots(self.latent, input_pos, latent.to(self.latent.dtype), rows)
        return self.latent[:, :, :kv_len] if rows is None else self.latent[rows, :, :kv_len]

    def read_span(self, row: int, start: int, end: int) -> Tensor:
        """The latents of positions start..end-1 of row `row`: [1, 1, end - start, width]."""
        return self.latent[row, :, start:end][None]

    def write_span(self, row: int, start: int, kv: Tensor) -> None:
        """Put latents [1, 1, n, width] (read_span's) at positions start.. of row `row`."""
        self.latent[row, :, start : start + kv.shape[2]] = kv[0]


class WindowKVCache(nn.Module):
    """The cache of a sliding-window layer: a ring of `size` slots per row (the window plus
    WINDOW_SLACK), position p in slot p % size, so it never grows with the sequence and a decode
    step reads `size` slots, not the whole prefix. Each slot remembers its position (-1: empty).

    A call's queries attend over the ring as it was before the call (its slots at or past the
    call's first position are stale: a rewound sequence, rejected drafts) and over the call's
    own keys, so a prefill longer than the ring needs nothing evicted before it is used; then the
    call's last `size` positions are written.

    The last position a cache of `max_len` slots holds, max_len - 1, is never written to the ring:
    no later call has a query beyond it that could read it back, and the serve engine runs its
    idle rows' dummy tokens there, which must not overwrite the ring of a row that is between two
    prefill chunks or keeps a finished request's keys for reuse (genfast/serve/engine.py)."""

    def __init__(
        self,
        batch: int,
        size: int,
        n_kv_heads: int,
        head_dim: int,
        window: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.size, self.window, self.max_len = size, window, max_len
        shape = (batch, n_kv_heads, size + 1, head_dim)  # + 1: where the writes that are dropped go
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        empty = torch.full((batch, size + 1), -1, dtype=torch.long, device=device)
        self.register_buffer("pos", empty, persistent=False)

    def attend_inputs(
        self, input_pos: Tensor, k: Tensor, v: Tensor, mask: Tensor, rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        bsz, _, seqlen, _ = k.shape
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if rows is None:
            rows = torch.arange(bsz, device=k.device)
        ring = slice(0, self.size)
        old_k, old_v, old_pos = self.k[rows, :, ring], self.v[rows, :, ring], self.pos[rows, ring]
        pos = input_pos.expand(bsz, seqlen)
        key_pos = torch.cat([old_pos, pos], dim=1)  # [B, size + S]
        current = torch.cat([(old_pos >= 0) & (old_pos < pos[:, :1]), torch.ones_like(pos, dtype=torch.bool)], 1)
        query_pos, kp = pos[:, None, :, None], key_pos[:, None, None, :]
        attended = current[:, None, None, :] & (kp <= query_pos) & (kp > query_pos - self.window)
        # Causality and left padding as the shared mask has them, read at each key's position
        # (clamped: stale and empty slots, masked already, may hold any position).
        shared = mask.expand(bsz, 1, seqlen, mask.shape[-1])
        at = kp.clamp(0, mask.shape[-1] - 1).expand(bsz, 1, seqlen, key_pos.shape[1])
        attended = attended & shared.gather(-1, at)
        keys, values = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)

        kept = (torch.arange(seqlen, device=k.device) >= seqlen - self.size) & (pos < self.max_len - 1)
        slots = torch.where(kept, pos % self.size, self.size)  # the others to the spare slot
        self.k[rows[:, None], :, slots] = k.transpose(1, 2)
        self.v[rows[:, None], :, slots] = v.transpose(1, 2)
        self.pos[rows[:, None], slots] = pos
        return keys, values, attended

    dtype = KVCache.dtype
    slot_bytes = KVCache.slot_bytes

    def slots_read(self, kv_len: float) -> float:
        return min(kv_len, self.size)

    def held_positions(self, row: int) -> set[int]:
        """The positions whose keys and values the ring of row `row` holds."""
        return {p for p in self.pos[row, : self.size].tolist() if p >= 0}

    def read_span(self, row: int, start: int, end: int) -> Tensor:
        """Keys and values of positions start..end-1 of row `row`, which the ring must hold (see
        `held_positions`): [2, kv_heads, end - start, head_dim]."""
        slots = torch.arange(start, end, device=self.k.device) % self.size
        return torch.stack([self.k[row, :, slots], self.v[row, :, slots]])

    def write_span(self, row: int, start: int, kv: Tensor) -> None:
        """Make row `row`'s ring hold exactly the keys and values [2, kv_heads, n, head_dim] (n at
        most `size`) at positions start..: as if they were the only positions written so far."""
        positions = torch.arange(start, start + kv.shape[2], device=self.k.device)
        slots = positions % self.size
        self.pos[row] = -1
        self.k[row, :, slots] = kv[0]
        self.v[row, :, slots] = kv[1]
        self.pos[row, slots] = positions


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, S, D]; cos/sin: [S, R/2] (rotate-half layout) for the first R dims of each head
    (R < D: partial rotary embedding, the rest passes through)."""
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    half = rotary // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CacheRows:
    """A model's KV caches seen as rows of positions (one row per sequence of the batch), split
    into full caches (KVCache, LatentKVCache) and sliding-window rings (all of one shape per
    position: the same kv heads and head dim in every layer). `Transformer.cache_rows()` makes one."""

    def __init__(self, caches: Sequence[KVCache | WindowKVCache | LatentKVCache]) -> None:
        self.full = [c for c in caches if not isinstance(c, WindowKVCache)]
        self.rings = [c for c in caches if isinstance(c, WindowKVCache)]
        # The positions before a kept prefix that the rings must hold: the longest window.
        self.window = max((ring.window for ring in self.rings), default=0)

    def ring_positions(self, row: int) -> set[int] | None:
        """The positions the rings of row `row` hold (all rings are written alike); None: no rings."""
        return self.rings[0].held_positions(row) if self.rings else None

    def reusable(self, row: int, common: int) -> int:
        """How many of the `common` leading positions that row `row` shares with a new call's
        tokens the call can skip: all, unless a ring has overwritten part of the window just
        before them (a ring keeps only its latest positions)."""
        held = self.ring_positions(row) if common else None
        if held is None or all(p in held for p in range(max(0, common - self.window), common)):
            return common
        return 0


class Attention(nn.Module):
    # Every query through the native kernel, whose result for a query does not depend on the other
    # queries, rows or cache length of the call (set by genfast.llm.model.invariance).
    batch_invariant = False

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = Linear(args.dim, qkv_out, bias=args.qkv_bias)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=args.out_bias)
        self.kv_cache: KVCache | WindowKVCache | None = None
        self.sliding_window: int | None = args.sliding_window  # a family may set it per layer (Gemma)
        self.scale = args.head_dim**-0.5  # of the scores q.k; a family may set its own (Gemma, Granite)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, mask: Tensor, cache_rows: Tensor | None = None
    ) -> Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.project(x)
        q, k = self.rotate(q, k, cos, sin, input_pos)

        if self.kv_cache is None:  # no cache: attend within this call only
            keys, values = k, v
            if self.sliding_window is not None:
                mask = window_mask(mask, input_pos, self.sliding_window)
        else:
            keys, values, mask = self.kv_cache.attend_inputs(input_pos, k, v, mask, cache_rows)

        out = self.attend(q, keys, values, mask, input_pos)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim))

    def new_cache(
        self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str | None
    ) -> KVCache | WindowKVCache:
        """The cache this layer attends through (`Transformer.setup_caches`): a ring of its window
        where that is shorter than max_len, else a full cache; its own kv heads (a tensor-parallel
        shard holds a slice)."""
        window = self.sliding_window
        if window is not None and window + WINDOW_SLACK < max_len:
            ring = window + WINDOW_SLACK
            return WindowKVCache(batch, ring, self.n_kv_heads, self.head_dim, window, max_len, dtype, device)
        return KVCache(batch, max_len, self.n_kv_heads, self.head_dim, dtype, device, window)

    def rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        """q and k with the rotary embedding applied (cos/sin: the model's, at input_pos)."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        """Attention of q [B, H, S, D] over the valid keys and values [B, KV, L, D]: [B, H, S, D]."""
        if self.batch_invariant:
            return decode_attention.decode_attention(q, keys, values, mask, self.scale)
        if decode_attention.applies(q, keys, mask):
            return decode_attention.decode_attention(q, keys, values, mask, self.scale)
        if q.shape[2] == 1 and torch.compiler.is_compiling():  # the kernel's PyTorch path
            return decode_attention.portable(q, keys, values, mask, self.scale)
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # a bf16 cache under fp32 compute
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True, scale=self.scale)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of `x` [B, S, dim], each [B, heads, S, head_dim], before rotary embedding (a
        family that normalizes q and k per head overrides this)."""
        q, k, v = self.projections(x)
        return self.heads(q), self.heads(k), self.heads(v)

    def projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of `x` [B, S, dim] as projected: [B, S, heads * head_dim] each."""
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)

    def heads(self, x: Tensor) -> Tensor:
        """[B, S, n * head_dim] -> [B, n, S, head_dim]."""
        return x.view(*x.shape[:2], -1, self.head_dim).transpose(1, 2)


class FeedForward(nn.Module):
    """The gated MLP: w2(act(gate) * up), gate and up one fused projection (SwiGLU by default)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, bias=False)  # gate ‖ up
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.intermediate_size, dim=-1)
        return self.w2(self.activation(gate) * up)

    def activation(self, gate: Tensor) -> Tensor:
        return F.silu(gate)


class TransformerBlock(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream; `attention`: the family's
    attention class; `moe`: the MLP is a mixture of experts (genfast/llm/model/moe.py), of
    `moe_type` (a family's subclass, e.g. with shared experts)."""

    def __init__(
        self,
        args: ModelArgs,
        attention: type[nn.Module] = Attention,
        moe: bool = False,
        moe_type: type[MoEFeedForward] = MoEFeedForward,
    ) -> None:
        super().__init__()
        self.attention = attention(args)
        self.feed_forward = moe_type(args) if moe else FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, mask: Tensor, cache_rows: Tensor | None = None
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos, mask, cache_rows)
        return h + self.feed_forward(self.ffn_norm(h))
