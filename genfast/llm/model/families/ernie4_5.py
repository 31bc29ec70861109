"""ERNIE 4.5 (dense; model_type ernie4_5): Llama's blocks with the rotary embedding applied to
interleaved pairs of q/k dims (0 and 1, 2 and 3, ...) instead of the two halves. Both its HF
checkpoints and llama.cpp's GGUF files (converted without permuting; llama.cpp rotates pairs)
store q/k rows in that order; the loader reorders them to the halves genfast rotates (the
scores q.k do not change when q and k rows are reordered alike)."""

from __future__ import annotations

from typing import Any

from genfast.errors import UserError
from genfast.llm.model.families.base import Family


def _fields(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("use_bias"):  # it covers the MLP's projections too, which genfast has no biases for
        raise UserError("ERNIE 4.5 checkpoints with use_bias (biases in every projection) are not supported")
    return {"qkv_bias": False, "out_bias": False}


FAMILY = Family(
    "ernie4_5",
    ("ernie4_5",),
    ("ernie4_5",),
    _fields,
    hf_rope_interleaved=True,
    gguf_rope_interleaved=True,
)
