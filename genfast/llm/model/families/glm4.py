"""GLM-4 (0414; model_type glm4): Gemma 2's four norms per block (before and after attention and
MLP; plain RMSNorm here) around Llama's attention and SwiGLU MLP, with q/k/v biases, gate and up
stored as one `gate_up_proj`, and the rotary embedding on interleaved pairs of the first half of
each head's dims. HF checkpoints and llama.cpp's GGUF files (converted without permuting) keep
q/k rows in that order; the loader reorders them to the halves genfast rotates."""

from __future__ import annotations

from typing import Any

from genfast.llm.model.families.base import Family
from genfast.llm.model.families.gemma2 import GemmaBlock
from genfast.llm.model.layers import Attention, FeedForward, RMSNorm


class SandwichBlock(GemmaBlock):
    """Gemma 2's block with plain RMSNorm and a SwiGLU MLP."""

    norm_type = RMSNorm
    feed_forward_type = FeedForward


def _fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": bool(cfg.get("attention_bias", True)), "out_bias": False}


FAMILY = Family(
    "glm4",
    ("glm4",),
    ("glm4",),
    _fields,
    block=lambda args, i: SandwichBlock(args, Attention(args)),
    hf_layer_tensors={
        "post_attention_norm.weight": ["post_self_attn_layernorm.weight"],
        "post_ffn_norm.weight": ["post_mlp_layernorm.weight"],
        "feed_forward.w13.weight": ["mlp.gate_up_proj.weight"],
    },
    gguf_layer_tensors={
        "post_attention_norm.weight": ["post_attention_norm.weight"],
        "post_ffn_norm.weight": ["post_ffw_norm.weight"],
        "feed_forward.w13.weight": ["ffn_up.weight"],  # llama.cpp keeps gate and up fused
    },
    hf_rope_interleaved=True,
    gguf_rope_interleaved=True,
)
