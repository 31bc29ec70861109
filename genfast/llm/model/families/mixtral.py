"""Mixtral: Mistral's blocks with a mixture-of-experts MLP in every layer (top-2 of 8 experts,
weights renormalized). GGUF files of Mixtral are architecture "llama" with an expert count, read
by the Llama family with the shared expert tensors."""

from __future__ import annotations

from typing import Any

from genfast.llm.model.families.base import Family
from genfast.llm.model.families.llama import attention_bias_fields


def _fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        **attention_bias_fields(cfg),
        "n_experts": int(cfg["num_local_experts"]),
        "n_active_experts": int(cfg["num_experts_per_tok"]),
        "expert_intermediate_size": int(cfg["intermediate_size"]),
        "normalize_expert_weights": True,
    }


FAMILY = Family(
    "mixtral",
    ("mixtral",),
    (),
    _fields,
    hf_expert_tensors={
        "feed_forward.router.weight": ["block_sparse_moe.gate.weight"],
        "feed_forward.w13.weight": ["block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"],
        "feed_forward.w2.weight": ["block_sparse_moe.experts.{e}.w2.weight"],
    },
    sliding_window_by_default=True,
)
