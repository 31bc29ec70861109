"""Qwen3 (dense): no q/k/v biases; q and k are RMS-normalized per head before the rotary
embedding, with one weight of head_dim shared by all heads (so tensor parallelism replicates it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from genfast.llm.model.families.base import QK_NORM_GGUF_TENSORS, QK_NORM_HF_TENSORS, Family
from genfast.llm.model.families.llama import attention_bias_fields
from genfast.llm.model.layers import Attention, RMSNorm, TransformerBlock

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs


class Qwen3Attention(Attention):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


FAMILY = Family(
    "qwen3",
    ("qwen3",),
    ("qwen3",),
    attention_bias_fields,
    block=lambda args, i: TransformerBlock(args, Qwen3Attention),
    hf_layer_tensors=QK_NORM_HF_TENSORS,
    gguf_layer_tensors=QK_NORM_GGUF_TENSORS,
)
