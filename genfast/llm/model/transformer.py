"""A decoder-only language model with a static KV cache: embedding, the blocks of its family
(genfast/llm/model/families/: Llama 2/3/3.x, Mistral, Mixtral, SmolLM, SmolLM3, TinyLlama, Qwen2,
Qwen3, Qwen3-MoE, Phi-3/4, Gemma 2/3, OLMo 2/3, EXAONE 4.0, Granite, Seed-OSS, ERNIE 4.5, GLM-4,
Hunyuan dense, gpt-oss, DeepSeek-V3/R1 and Kimi K2, GLM-4.5/4.6), final norm and output head. The
shared blocks are in genfast/llm/model/layers.py, the mixture-of-experts MLP in
genfast/llm/model/moe.py.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from genfast.llm.model import families
from genfast.llm.model.config import ModelArgs, rope_inverse_frequencies
from genfast.llm.model.layers import CacheRows
from genfast.llm.model.moe import MoEFeedForward
from genfast.nn import DtypeAttribute, Linear


class Transformer(nn.Module):
    # The KV caches' dtype; None: the compute dtype. bf16 where fp32 compute keeps bf16 weights
    # (--dtype auto on a CPU without native bf16): decode reads half the cache's bytes.
    cache_dtype = DtypeAttribute()

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.family = families.family(args.family)  # its blocks, final norm and hooks
        self.layers = nn.ModuleList(self.family.block(args, i) for i in range(args.n_layers))
        self.norm = self.family.norm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", torch.empty(args.rotary_dim // 2), persistent=False)
        self.longrope = args.rope_scaling is not None and args.rope_scaling.kind == "longrope"
        if self.longrope:  # LongRoPE: a second set of frequencies, beyond the original context
            self.register_buffer("inv_freq_long", torch.empty(args.rotary_dim // 2), persistent=False)
        self.reset_rope()
        self.max_batch_size = 0
        self.max_seq_len = 0
        self.cache_dtype = None

    def reset_rope(self) -> None:
        """(Re)compute the rotary inverse frequencies in fp32 on the model's device, and those of
        any layer with its own (Gemma 3's local layers: a `reset_rope` method of theirs)."""
        if self.inv_freq.is_meta:
            return
        for module in self.layers.modules():
            if hasattr(module, "reset_rope"):
                module.reset_rope()
        freqs = rope_inverse_frequencies(self.args)
        self.inv_freq = torch.tensor(freqs, dtype=torch.float32, device=self.inv_freq.device)
        if self.longrope:
            long = rope_inverse_frequencies(self.args, long=True)
            self.inv_freq_long = torch.tensor(long, dtype=torch.float32, device=self.inv_freq.device)

    def setup_caches(self, batch_size: int, max_seq_len: int) -> None:
        """Allocate static KV caches (in the model's dtype and device) for `max_seq_len` slots."""
        if max_seq_len > self.args.max_seq_len:
            raise ValueError(f"cache of {max_seq_len} exceeds the model's context of {self.args.max_seq_len}")
        dtype = self.cache_dtype or self.norm.weight.dtype  # norm: the compute dtype (linears may store bf16)
        current = self.layers[0].attention.kv_cache
        if (batch_size, max_seq_len) == (self.max_batch_size, self.max_seq_len) and current.dtype == dtype:
            return
        device = self.norm.weight.device
        for layer in self.layers:  # each layer's own kind of cache (layers.Attention.new_cache)
            layer.attention.kv_cache = layer.attention.new_cache(batch_size, max_seq_len, dtype, device)
        self.max_batch_size, self.max_seq_len = batch_size, max_seq_len

    def cache_rows(self) -> CacheRows:
        """The KV caches (`setup_caches`) as rows of positions: what a new call may reuse of them."""
        return CacheRows([layer.attention.kv_cache for layer in self.layers])

    def rope(self, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 cos and sin of the rotary angles at `input_pos` [S]: [S, rotary_dim // 2] each; for
        per-row positions [B, S]: [B, 1, S, rotary_dim // 2] (broadcast over heads).

        LongRoPE takes its long frequencies once the sequence outgrows the original context, for
        every position of the call, as transformers does (a device-side choice: no host sync)."""
        inv_freq = self.inv_freq
        if self.longrope:
            beyond = input_pos.max() + 1 > self.args.rope_scaling.original_max_position_embeddings
            inv_freq = torch.where(beyond, self.inv_freq_long, self.inv_freq)
        angles = input_pos.to(torch.float32)[..., None] * inv_freq.float()
        if input_pos.dim() == 2:
            angles = angles[:, None]
        scaling = self.args.rope_scaling
        if scaling is not None and scaling.kind in ("longrope", "yarn"):  # their cos and sin scale
            return angles.cos() * scaling.attention_factor, angles.sin() * scaling.attention_factor
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
        self-draft for speculative decoding; genfast.llm.decoding.speculative).
        """
        if mask is None:
            mask = attention_mask(input_pos, tokens.shape[1])
        cos, sin = self.rope(input_pos)

        x = self.tok_embeddings(tokens).to(self.norm.weight.dtype)  # the table may be stored in bf16
        x = self.family.scale_embeddings(self.args, x)
        for layer in self.layers[:n_layers]:
            x = layer(x, cos, sin, input_pos, mask, cache_rows)
        if not all_logits:
            x = x[:, -1]
        return self.family.final_logits(self.args, self.output(self.norm(x)).float())


@functools.lru_cache(maxsize=16)
def parameter_counts(args: ModelArgs) -> tuple[int, int]:
    """(all parameters, those a token uses) of the model `args` describe: the values a checkpoint
    stores for it (embedding and output head counted once when tied; every expert; a family's own
    norms, biases, sinks and latent projections), counted on the model built on the meta device,
    so no formula of each family's shapes has to be kept in step; a token uses k of each
    mixture's E experts, and the rest of the model."""
    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            stacked = sum(t.numel() for t in module.expert_tensors())
            idle += stacked * (args.n_experts - args.n_active_experts) // args.n_experts
    return total, total - idle


def describe_size(args: ModelArgs) -> str:
    """E.g. '135M parameters', or for a mixture '30.5B parameters, 3.3B active (8 of 128 experts)'."""

    def count(n: int) -> str:
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"

    total, active = parameter_counts(args)
    if not args.n_experts:
        return f"{count(total)} parameters"
    return f"{count(total)} parameters, {count(active)} active ({args.n_active_experts} of {args.n_experts} experts)"


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
