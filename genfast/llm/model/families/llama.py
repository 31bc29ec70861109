"""Llama 2/3/3.x (and SmolLM, TinyLlama) and Mistral: the shared blocks as they are."""

from __future__ import annotations

from typing import Any

from genfast.llm.model.families.base import Family


def attention_bias_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))  # covers o_proj too
    return {"qkv_bias": bias, "out_bias": bias}


FAMILY = Family(
    "llama",
    ("llama", "mistral"),
    ("llama",),
    attention_bias_fields,
    gguf_rope_interleaved=True,
    sliding_window_by_default=True,
)
