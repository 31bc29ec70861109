"""Hunyuan dense (model_type hunyuan_v1_dense): Llama's blocks with per-head q/k RMSNorm applied
after the rotary embedding (Qwen3 normalizes before it), and "dynamic" rope scaling that is NTK
alpha scaling: a fixed larger base, rope_theta * alpha ** (head_dim / (head_dim - 2)), which
llama.cpp's converter writes into the GGUF file's base frequency."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from genfast.llm.model.families.base import QK_NORM_GGUF_TENSORS, Family
from genfast.llm.model.families.llama import attention_bias_fields
from genfast.llm.model.families.qwen3 import Qwen3Attention
from genfast.llm.model.layers import Attention, TransformerBlock


class NormAfterRopeAttention(Qwen3Attention):
    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return Attention.project(self, x)  # no norms yet: after rotating

    def rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        q, k = super().rotate(q, k, cos, sin, input_pos)
        return self.q_norm(q), self.k_norm(k)


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    fields = attention_bias_fields(cfg)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    alpha = rope.get("alpha")
    if (rope.get("rope_type") or rope.get("type")) == "dynamic" and alpha:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        fields.update(rope_theta=theta * float(alpha) ** (head_dim / (head_dim - 2)), rope_scaling=None)
    return fields


FAMILY = Family(
    "hunyuan_dense",
    ("hunyuan_v1_dense",),
    ("hunyuan-dense",),
    hf_fields,
    block=lambda args, i: TransformerBlock(args, NormAfterRopeAttention),
    hf_layer_tensors={
        "attention.q_norm.weight": ["self_attn.query_layernorm.weight"],
        "attention.k_norm.weight": ["self_attn.key_layernorm.weight"],
    },
    gguf_layer_tensors=QK_NORM_GGUF_TENSORS,
)
