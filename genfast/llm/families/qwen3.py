"""Qwen3 (dense): no q/k/v biases; q and k are RMS-normalized per head before the rotary
embedding, with one weight of head_dim shared by all heads (so tensor parallelism replicates it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from genfast.llm.families.base import Family
from genfast.llm.layers import Attention, RMSNorm, TransformerBlock

if TYPE_CHECKING:
    from genfast.llm.config import ModelArgs


class Qwen3Attention(Attention):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


def _fields(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "out_bias": bias}


FAMILY = Family(
    "qwen3",
    ("qwen3",),
    ("qwen3",),
    _fields,
    block=lambda args, i: TransformerBlock(args, Qwen3Attention),
    hf_layer_tensors={
        "attention.q_norm.weight": ["self_attn.q_norm.weight"],
        "attention.k_norm.weight": ["self_attn.k_norm.weight"],
    },
    gguf_layer_tensors={
        "attention.q_norm.weight": ["attn_q_norm.weight"],
        "attention.k_norm.weight": ["attn_k_norm.weight"],
    },
)
