"""Seed-OSS (ByteDance): Llama's blocks with q/k/v biases (`attention_bias`) apart from the output
projection's (`attention_out_bias`)."""

from __future__ import annotations

from typing import Any

from genfast.llm.model.families.base import Family


def _fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": bool(cfg.get("attention_bias", True)), "out_bias": bool(cfg.get("attention_out_bias", False))}


FAMILY = Family("seed_oss", ("seed_oss",), ("seed_oss",), _fields)
