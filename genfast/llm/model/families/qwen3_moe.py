"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a mixture-of-experts MLP (e.g. 8 of 128
experts) in every layer but those its config keeps dense (mlp_only_layers, decoder_sparse_step)."""

from __future__ import annotations

from typing import Any

from genfast.llm.model.families.base import QK_NORM_GGUF_TENSORS, QK_NORM_HF_TENSORS, Family
from genfast.llm.model.families.llama import attention_bias_fields
from genfast.llm.model.families.qwen3 import Qwen3Attention
from genfast.llm.model.layers import TransformerBlock


def _fields(cfg: dict[str, Any]) -> dict[str, Any]:
    n_layers, step = cfg["num_hidden_layers"], int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or ())
    return {
        **attention_bias_fields(cfg),
        # transformers 5 writes num_local_experts, the published checkpoints num_experts.
        "n_experts": int(cfg.get("num_experts") or cfg["num_local_experts"]),
        "n_active_experts": int(cfg["num_experts_per_tok"]),
        "expert_intermediate_size": int(cfg["moe_intermediate_size"]),
        "normalize_expert_weights": bool(cfg.get("norm_topk_prob", False)),
        "dense_layers": tuple(i for i in range(n_layers) if i in dense_only or (i + 1) % step),
    }


FAMILY = Family(
    "qwen3_moe",
    ("qwen3_moe",),
    ("qwen3moe",),
    _fields,
    block=lambda args, i: TransformerBlock(args, Qwen3Attention, moe=args.is_moe_layer(i)),
    hf_layer_tensors=QK_NORM_HF_TENSORS,
    gguf_layer_tensors=QK_NORM_GGUF_TENSORS,
    hf_expert_tensors={
        "feed_forward.router.weight": ["mlp.gate.weight"],
        "feed_forward.w13.weight": ["mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"],
        "feed_forward.w2.weight": ["mlp.experts.{e}.down_proj.weight"],
    },
)
