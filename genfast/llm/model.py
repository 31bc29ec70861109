"""A Llama-family decoder (Llama 2/3/3.x, Mistral, SmolLM, TinyLlama, Qwen2) with a static KV cache.

Layout choices, all for decode speed:
- q/k/v are one fused projection and gate/up another, so a layer runs four matmuls, not seven.
- The KV cache is a fixed buffer per layer; attention reads only its valid prefix, whose length
  is the attention mask's last dimension. Compiled with that dimension dynamic, one graph
  serves every length.
- Rotary embeddings use the Hugging Face (rotate-half) layout, so HF weights load unpermuted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.llm.config import ModelArgs, rope_inverse_frequencies
from genfast.nn import Linear


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


class KVCache(nn.Module):
    """Static per-layer key/value buffers of shape [batch, kv_heads, max_len, head_dim]."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, rows: Tensor | None = None) -> None:
        """Write k/v [B, kv_heads, S, D] at slots input_pos: [S] shared by all rows, or [B, S]
        per row (continuous batching, where each sequence is at its own length). rows: [B], the
        cache rows the batch rows write (default: all, in order)."""
        if input_pos.dim() == 1 and rows is None:
            self.k.index_copy_(2, input_pos, k)
            self.v.index_copy_(2, input_pos, v)
            return
        if rows is None:
            rows = torch.arange(k.shape[0], device=k.device)
        pos = input_pos.expand(k.shape[0], k.shape[2])
        # Advanced indices on dims 0 and 2 put the indexed dims first: the target is [B, S, H, D].
        self.k[rows[:, None], :, pos] = k.transpose(1, 2)
        self.v[rows[:, None], :, pos] = v.transpose(1, 2)

    def read(self, kv_len: int, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values of the first kv_len slots, of all rows or of `rows` [B] (a copy)."""
        if rows is None:
            return self.k[:, :, :kv_len], self.v[:, :, :kv_len]
        return self.k[rows, :, :kv_len], self.v[rows, :, :kv_len]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, S, D]; cos/sin: [S, D/2] (rotate-half layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = Linear(args.dim, qkv_out, bias=args.qkv_bias)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=args.out_bias)
        self.kv_cache: KVCache | None = None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, mask: Tensor, cache_rows: Tensor | None = None
    ) -> Tensor:
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if self.kv_cache is None:  # no cache: attend within this call only
            keys, values = k, v
        else:
            self.kv_cache.update(input_pos, k, v, cache_rows)
            keys, values = self.kv_cache.read(mask.shape[-1], cache_rows)

        if seqlen == 1 and torch.compiler.is_compiling():
            out = self._decode_attention(q, keys, values, mask)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, q_size))

    def _decode_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """One query per sequence, grouped by KV head (no KV repeat), in fp32, as multiply-sums.

        Compiled, this fuses into a few loops over the valid cache prefix. SDPA's CPU flash kernel
        is tiled for long queries and costs ~0.45 us per cached token per layer for one query:
        at 1,100 cached tokens SmolLM2 decodes at 44 tok/s with it and 88 tok/s with this
        (docs/performance.md). Used only under torch.compile: eagerly it would materialize the
        products.
        """
        bsz, _, _, hd = q.shape
        group = self.n_heads // self.n_kv_heads
        qg = q.view(bsz, self.n_kv_heads, group, 1, hd).float()
        scores = (qg * k[:, :, None].float()).sum(-1) * hd**-0.5  # [B, KV, G, L]
        scores = scores.masked_fill(~mask, float("-inf"))  # mask: [B|1, 1, 1, L]
        probs = scores.softmax(dim=-1)
        out = (probs[..., None] * v[:, :, None].float()).sum(-2)  # [B, KV, G, D]
        return out.to(q.dtype).view(bsz, self.n_heads, 1, hd)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, bias=False)  # gate ‖ up
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.intermediate_size, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, mask: Tensor, cache_rows: Tensor | None = None
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos, mask, cache_rows)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", torch.empty(args.head_dim // 2), persistent=False)
        self.reset_rope()
        self.max_batch_size = 0
        self.max_seq_len = 0

    def reset_rope(self) -> None:
        """(Re)compute the rotary inverse frequencies in fp32 on the model's device."""
        if self.inv_freq.is_meta:
            return
        freqs = rope_inverse_frequencies(self.args)
        self.inv_freq = torch.tensor(freqs, dtype=torch.float32, device=self.inv_freq.device)

    def setup_caches(self, batch_size: int, max_seq_len: int) -> None:
        """Allocate static KV caches (in the model's dtype and device) for `max_seq_len` slots."""
        if max_seq_len > self.args.max_seq_len:
            raise ValueError(f"cache of {max_seq_len} exceeds the model's context of {self.args.max_seq_len}")
        if (batch_size, max_seq_len) == (self.max_batch_size, self.max_seq_len):
            return
        dtype = self.norm.weight.dtype  # the compute dtype (linears may store theirs in bf16, or codes)
        device = self.norm.weight.device
        for layer in self.layers:  # the layer's own kv heads: a tensor-parallel shard holds a slice
            layer.attention.kv_cache = KVCache(
                batch_size, max_seq_len, layer.attention.n_kv_heads, self.args.head_dim, dtype, device
            )
        self.max_batch_size, self.max_seq_len = batch_size, max_seq_len

    def rope(self, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 cos and sin of the rotary angles at `input_pos` [S]: [S, head_dim // 2] each; for
        per-row positions [B, S]: [B, 1, S, head_dim // 2] (broadcast over heads)."""
        angles = input_pos.to(torch.float32)[..., None] * self.inv_freq.float()
        if input_pos.dim() == 2:
            angles = angles[:, None]
        return angles.cos(), angles.sin()

    def clear_caches(self) -> None:
        for layer in self.layers:
            layer.attention.kv_cache = None
        self.max_batch_size = self.max_seq_len = 0

    def forward(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        mask: Tensor | None = None,
        all_logits: bool = False,
        cache_rows: Tensor | None = None,
        n_layers: int | None = None,
    ) -> Tensor:
        """Run `tokens` [B, S] at cache slots `input_pos` [S]; return fp32 logits.

        input_pos may also be [B, S]: each row at its own positions (continuous batching).
        cache_rows: [B], the KV-cache rows the batch rows use (default: all rows, in order), e.g.
        to prefill one new sequence into a free row while the others keep their caches.

        mask: boolean [B|1, 1, S, L] over the first L cache slots (see `attention_mask`); L is
        how many slots are valid after this call. Without a mask (and without caches) attention
        is causal within `tokens`, whose positions must then start at 0.
        all_logits: logits for every position [B, S, V]; otherwise for the last one [B, V].
        n_layers: run only the first n layers, then the final norm and head (an early-exit
        self-draft for speculative decoding; genfast.llm.speculative).
        """
        if mask is None:
            mask = attention_mask(input_pos, tokens.shape[1])
        cos, sin = self.rope(input_pos)

        x = self.tok_embeddings(tokens).to(self.norm.weight.dtype)  # the table may be stored in bf16
        for layer in self.layers[:n_layers]:
            x = layer(x, cos, sin, input_pos, mask, cache_rows)
        if not all_logits:
            x = x[:, -1]
        return self.output(self.norm(x)).float()


def attention_mask(input_pos: Tensor, kv_len: int, pad_start: Tensor | None = None) -> Tensor:
    """Boolean [B|1, 1, S, kv_len] mask for queries at `input_pos` ([S], or [B, S] per row) over
    the first kv_len slots: causal, minus each sequence's left padding (pad_start: [B] first real slot)."""
    key_pos = torch.arange(kv_len, device=input_pos.device)[None, None, None, :]
    query_pos = input_pos.reshape(-1, 1, input_pos.shape[-1], 1)
    mask = key_pos <= query_pos
    if pad_start is not None:
        # Padding queries still see themselves, so their rows stay finite (never NaN).
        real = key_pos >= pad_start[:, None, None, None]
        mask = mask & (real | (key_pos == query_pos))
    return mask
