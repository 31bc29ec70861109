"""Gemma 3 (text; model_type gemma3_text): Gemma 2's block (genfast/llm/model/families/gemma2.py) with
per-head q/k norms (1 + w), no soft-capping by default, five local (sliding-window) layers to one
global, and local layers rotating with their own base frequency (10,000) and no scaling while
global layers take the config's rope (1,000,000, linear scaling in the larger models)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from genfast.llm.model.families import gemma2
from genfast.llm.model.families.base import QK_NORM_GGUF_TENSORS, QK_NORM_HF_TENSORS, Family, family_args
from genfast.llm.model.families.gemma2 import GemmaArgs, GemmaAttention, GemmaBlock, GemmaRMSNorm

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs

LOCAL_ROPE_THETA = 10000.0  # what llama.cpp assumes for GGUF files, which do not store it
PATTERN = 6  # every sixth layer global


@dataclass(frozen=True)
class Gemma3Args(GemmaArgs):
    local_rope_theta: float = LOCAL_ROPE_THETA  # the local layers' rotary base frequency


class Gemma3Attention(GemmaAttention):
    def __init__(self, args: ModelArgs, local: bool) -> None:
        super().__init__(args, local)
        self.q_norm = GemmaRMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = GemmaRMSNorm(args.head_dim, args.norm_eps)
        self.local_theta = float(family_args(args, Gemma3Args).local_rope_theta) if local else None
        if local:
            self.register_buffer("local_inv_freq", torch.empty(args.rotary_dim // 2), persistent=False)
            self.reset_rope()

    def reset_rope(self) -> None:
        """Local layers' own inverse frequencies, in fp32 (Transformer.reset_rope calls it)."""
        if self.local_theta is None or self.local_inv_freq.is_meta:
            return
        n = self.local_inv_freq.shape[0]
        exponents = torch.arange(n, dtype=torch.float64, device=self.local_inv_freq.device) * 2 / (2 * n)
        self.local_inv_freq = (1.0 / self.local_theta**exponents).float()

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v

    def rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        if self.local_theta is not None:
            angles = input_pos.to(torch.float32)[..., None] * self.local_inv_freq
            if input_pos.dim() == 2:
                angles = angles[:, None]
            cos, sin = angles.cos(), angles.sin()
        return super().rotate(q, k, cos, sin, input_pos)


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    theta = float(cfg.get("rope_local_base_freq") or local.get("rope_theta", LOCAL_ROPE_THETA))
    every = cfg.get("sliding_window_pattern", PATTERN)
    return gemma2.hf_fields(cfg, every=every, kind=Gemma3Args, local_rope_theta=theta)


def gguf_fields(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """As llama.cpp reads Gemma 3: queries scale by head_dim except in the 62-layer 27B (dim / heads).
    GGUF files store no local rope base: the default (LOCAL_ROPE_THETA), as llama.cpp assumes."""
    own = {}
    if int(meta[f"{arch}.block_count"]) == 62:
        dim, heads = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.attention.head_count"])
        own["query_pre_attn_scalar"] = dim // heads
    return gemma2.gguf_fields(meta, arch, tensor_names, every=PATTERN, kind=Gemma3Args, **own)


def block(args: ModelArgs, i: int) -> GemmaBlock:
    return GemmaBlock(args, Gemma3Attention(args, local=i in family_args(args, Gemma3Args).sliding_layers))


FAMILY = Family(
    "gemma3",
    ("gemma3_text",),
    ("gemma3",),
    hf_fields,
    block=block,
    norm=GemmaRMSNorm,
    hf_layer_tensors={**gemma2.GEMMA_LAYER_TENSORS_HF, **QK_NORM_HF_TENSORS},
    gguf_layer_tensors={**gemma2.GEMMA_LAYER_TENSORS_GGUF, **QK_NORM_GGUF_TENSORS},
    gguf_fields=gguf_fields,
    gguf_tensor=gemma2.from_gguf_norm,
    args_type=Gemma3Args,
    scale_embeddings=gemma2.scale_embeddings,
    final_logits=gemma2.cap_final_logits,
)
