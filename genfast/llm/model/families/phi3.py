"""Phi-3, Phi-3.5 and Phi-4 (model_type phi3): q/k/v stored as one `qkv_proj` and gate/up as one
`gate_up_proj`, already in the fused layout genfast computes with (q, k, v rows; gate, then up);
LongRoPE and partial rotary embedding are shared rope variants (genfast.llm.model.config)."""

from __future__ import annotations

from typing import Any

from genfast.llm.model.families.base import Family


def _fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": False, "out_bias": False}


FAMILY = Family(
    "phi3",
    ("phi3",),
    ("phi3",),
    _fields,
    hf_layer_tensors={
        "attention.wqkv.weight": ["self_attn.qkv_proj.weight"],
        "feed_forward.w13.weight": ["mlp.gate_up_proj.weight"],
    },
    # llama.cpp keeps the fusions: attn_qkv, and ffn_up holding gate and up.
    gguf_layer_tensors={
        "attention.wqkv.weight": ["attn_qkv.weight"],
        "feed_forward.w13.weight": ["ffn_up.weight"],
    },
    sliding_window_by_default=True,
)
