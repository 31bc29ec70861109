"""Qwen2 and Qwen2.5: biases on q/k/v (not on the output projection)."""

from __future__ import annotations

from genfast.llm.model.families.base import Family

FAMILY = Family("qwen2", ("qwen2",), ("qwen2",), lambda cfg: {"qkv_bias": True, "out_bias": False})
