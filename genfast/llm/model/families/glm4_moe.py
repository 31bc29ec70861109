"""GLM-4.5 and GLM-4.6 (model_type glm4_moe; GGUF architecture glm4moe): DeepSeek-V3's mixture
(shared experts, group-limited sigmoid routing, dense first layers; genfast/llm/model/families/
deepseek.py) under ordinary grouped-query attention with q/k/v biases, partial rotary embedding
(half of each head by default) and, where the config says use_qk_norm, Qwen3's per-head q/k norms.

The multi-token-prediction layers that GLM checkpoints append (num_nextn_predict_layers) are not
read: genfast decodes with the main layers only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genfast.llm.model.families.base import QK_NORM_GGUF_TENSORS, QK_NORM_HF_TENSORS, Family, family_args
from genfast.llm.model.families.deepseek import (
    EXPERT_HF_TENSORS,
    SHARED_EXPERT_GGUF_TENSORS,
    SHARED_EXPERT_HF_TENSORS,
    SharedExpertArgs,
    SharedExpertMoE,
    gguf_shared_expert_values,
    hf_shared_expert_fields,
)
from genfast.llm.model.families.qwen3 import Qwen3Attention
from genfast.llm.model.layers import Attention, TransformerBlock

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs


@dataclass(frozen=True, kw_only=True)
class GlmMoeArgs(SharedExpertArgs):
    qk_norm: bool = False  # per-head q/k RMS norms (use_qk_norm)


def block(args: ModelArgs, i: int) -> TransformerBlock:
    attention = Qwen3Attention if family_args(args, GlmMoeArgs).qk_norm else Attention
    return TransformerBlock(args, attention, moe=args.is_moe_layer(i), moe_type=SharedExpertMoE)


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    fields = hf_shared_expert_fields(cfg)
    own = GlmMoeArgs(qk_norm=bool(cfg.get("use_qk_norm", False)), **fields["family_args"])
    # transformers' default when the config gives none (GLM-4.5's value)
    partial = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    bias = bool(cfg.get("attention_bias", False))
    return {**fields, "rotary_dim": int(head_dim * partial), "qkv_bias": bias, "out_bias": False, "family_args": own}


def gguf_fields(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """llama.cpp counts the multi-token-prediction layers in block_count; they are left out. The
    q/k norms are there where their tensors are (no key says so)."""
    own = GlmMoeArgs(qk_norm="blk.0.attn_q_norm.weight" in tensor_names, **gguf_shared_expert_values(meta, arch))
    n_layers = int(meta[f"{arch}.block_count"]) - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)
    return {"n_layers": n_layers, "family_args": own}


FAMILY = Family(
    "glm4_moe",
    ("glm4_moe",),
    ("glm4moe",),
    hf_fields,
    block=block,
    hf_layer_tensors={**QK_NORM_HF_TENSORS, **SHARED_EXPERT_HF_TENSORS},
    gguf_layer_tensors={
        **QK_NORM_GGUF_TENSORS,
        **SHARED_EXPERT_GGUF_TENSORS,
        "ffn_norm.weight": ["post_attention_norm.weight"],  # llama.cpp's name for glm4moe's
    },
    hf_expert_tensors=EXPERT_HF_TENSORS,
    gguf_fields=gguf_fields,
    args_type=GlmMoeArgs,
    not_shardable="the shared experts are not sharded",
)
