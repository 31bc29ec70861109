"""Gemma 2: RMSNorm scaling by (1 + w) in fp32, a norm before and after both attention and MLP,
GeGLU with tanh GELU, embeddings scaled by sqrt(dim), queries scaled by query_pre_attn_scalar,
attention-logit and final-logit soft-capping (cap * tanh(x / cap)), and sliding-window
attention on alternate layers (even layers local). Its own config values are a `GemmaArgs` in
`ModelArgs.family_args`; the embedding scale and final soft-cap are the Family's hooks.

A local layer's cache is a ring of its window (genfast.llm.model.layers.WindowKVCache): it does not
grow with the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.llm.model.config import FamilyArgs
from genfast.llm.model.families.base import Family, family_args
from genfast.llm.model.layers import Attention, FeedForward

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs

DEFAULT_WINDOW = 4096  # the local layers' window when a config does not give one


@dataclass(frozen=True)
class GemmaArgs(FamilyArgs):
    query_pre_attn_scalar: float  # queries scale by its inverse square root (not head_dim's)
    sliding_window: int  # the local layers' window
    sliding_layers: tuple[int, ...]  # the local layers
    attn_logit_softcap: float | None = None  # cap * tanh(scores / cap); None: none
    final_logit_softcap: float | None = None  # the same on the logits


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), all in fp32, then cast (the order Gemma's reference uses)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GeluFeedForward(FeedForward):
    def activation(self, gate: Tensor) -> Tensor:
        return F.gelu(gate, approximate="tanh")


class GemmaAttention(Attention):
    """Attention with its own query scale, optional logit soft-capping and, on local layers, a
    sliding window; computed explicitly (SDPA has no soft-capping), in fp32 scores."""

    def __init__(self, args: ModelArgs, local: bool) -> None:
        super().__init__(args)
        own = family_args(args, GemmaArgs)
        self.scale = float(own.query_pre_attn_scalar) ** -0.5
        self.softcap = own.attn_logit_softcap
        self.sliding_window = own.sliding_window if local else None

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        bsz, _, seqlen, hd = q.shape
        group = self.n_heads // self.n_kv_heads
        qg = q.reshape(bsz, self.n_kv_heads, group * seqlen, hd)
        scores = (qg @ keys.transpose(2, 3)).float() * self.scale  # [B, KV, G*S, L]
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.view(bsz, self.n_kv_heads, group, seqlen, -1).masked_fill(~mask[:, :, None], float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype).view(bsz, self.n_kv_heads, group * seqlen, -1)
        return (probs @ values).view(bsz, self.n_heads, seqlen, hd)


class GemmaBlock(nn.Module):
    """Norms before and after attention and MLP; the same attribute names as the shared block
    (attention, feed_forward, attention_norm, ffn_norm), so quantization and sharding apply.
    `norm_type` and `feed_forward_type`: Gemma's; a family with the same four norms may take others."""

    norm_type: type[nn.Module] = GemmaRMSNorm
    feed_forward_type: type[FeedForward] = GeluFeedForward

    def __init__(self, args: ModelArgs, attention: Attention) -> None:
        super().__init__()
        self.attention = attention
        self.feed_forward = self.feed_forward_type(args)
        self.attention_norm = self.norm_type(args.dim, args.norm_eps)
        self.post_attention_norm = self.norm_type(args.dim, args.norm_eps)
        self.ffn_norm = self.norm_type(args.dim, args.norm_eps)
        self.post_ffn_norm = self.norm_type(args.dim, args.norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, mask: Tensor, cache_rows: Tensor | None = None
    ) -> Tensor:
        attended = self.attention(self.attention_norm(x), cos, sin, input_pos, mask, cache_rows)
        h = x + self.post_attention_norm(attended)
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


def sliding_layers(n_layers: int, every: int) -> tuple[int, ...]:
    """Gemma's layer pattern: every `every`-th layer (1-based) global, the others local."""
    return tuple(i for i in range(n_layers) if (i + 1) % every)


def hf_fields(cfg: dict[str, Any], every: int = 2, kind: type[GemmaArgs] = GemmaArgs, **own: Any) -> dict[str, Any]:
    """ModelArgs fields from a HF config; `kind` and `own`: a later Gemma's args and values of its own."""
    types = cfg.get("layer_types")
    local = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if types else None
    values = {
        "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar", 256),
        "attn_logit_softcap": cfg.get("attn_logit_softcapping"),
        "final_logit_softcap": cfg.get("final_logit_softcapping"),
        "sliding_window": cfg.get("sliding_window") or DEFAULT_WINDOW,
        "sliding_layers": local if local is not None else sliding_layers(cfg["num_hidden_layers"], every),
    }
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "out_bias": bias, "family_args": kind(**{**values, **own})}


def gguf_fields(
    meta: dict[str, Any],
    arch: str,
    tensor_names: set[str],
    every: int = 2,
    kind: type[GemmaArgs] = GemmaArgs,
    **own: Any,
) -> dict[str, Any]:
    """GGUF stores no query_pre_attn_scalar; as llama.cpp does, queries scale by head_dim
    (key_length, Gemma 2 2B and 9B) except for the 46-layer 27B, which uses dim / heads."""
    n_layers, dim = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.embedding_length"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", dim // int(meta[f"{arch}.attention.head_count"])))
    scalar = dim // int(meta[f"{arch}.attention.head_count"]) if arch == "gemma2" and n_layers == 46 else head_dim
    values = {
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcap": meta.get(f"{arch}.attn_logit_softcapping"),
        "final_logit_softcap": meta.get(f"{arch}.final_logit_softcapping"),
        "sliding_window": int(meta.get(f"{arch}.attention.sliding_window", DEFAULT_WINDOW)),
        "sliding_layers": sliding_layers(n_layers, every),
    }
    return {"family_args": kind(**{**values, **own})}


def scale_embeddings(args: ModelArgs, x: Tensor) -> Tensor:
    """Embeddings times sqrt(dim), the scale rounded to their dtype (as Gemma's reference)."""
    return x * torch.tensor(args.dim**0.5, dtype=x.dtype)


def cap_final_logits(args: ModelArgs, logits: Tensor) -> Tensor:
    """cap * tanh(logits / cap) where the config has a cap (Gemma 2; Gemma 3 has none)."""
    cap = family_args(args, GemmaArgs).final_logit_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap


def from_gguf_norm(name: str, tensor: Tensor) -> Tensor:
    """llama.cpp's converter stores Gemma's norm weights as 1 + w."""
    return tensor - 1 if name.endswith("norm.weight") else tensor


def block(args: ModelArgs, i: int) -> GemmaBlock:
    return GemmaBlock(args, GemmaAttention(args, local=i in family_args(args, GemmaArgs).sliding_layers))


GEMMA_LAYER_TENSORS_HF = {
    "post_attention_norm.weight": ["post_attention_layernorm.weight"],
    "ffn_norm.weight": ["pre_feedforward_layernorm.weight"],
    "post_ffn_norm.weight": ["post_feedforward_layernorm.weight"],
}
GEMMA_LAYER_TENSORS_GGUF = {
    "post_attention_norm.weight": ["post_attention_norm.weight"],
    "ffn_norm.weight": ["ffn_norm.weight"],  # llama.cpp's FFN_PRE_NORM
    "post_ffn_norm.weight": ["post_ffw_norm.weight"],
}

FAMILY = Family(
    "gemma2",
    ("gemma2",),
    ("gemma2",),
    hf_fields,
    block=block,
    norm=GemmaRMSNorm,
    hf_layer_tensors=GEMMA_LAYER_TENSORS_HF,
    gguf_layer_tensors=GEMMA_LAYER_TENSORS_GGUF,
    gguf_fields=gguf_fields,
    gguf_tensor=from_gguf_norm,
    args_type=GemmaArgs,
    scale_embeddings=scale_embeddings,
    final_logits=cap_final_logits,
)
