"""Ministral 3 (model_type ministral3: the language model of Ministral 3 3B/8B/14B, shipped in a
Mistral3ForConditionalGeneration): Mistral's blocks and YaRN, with Llama 4's attention
temperature: past the original context, queries are scaled by 1 + beta * log(1 + floor(position /
original context)), both from the config's rope parameters (`llama_4_scaling_beta`). Within the
original context the scale is 1.

llama.cpp's converter writes Mistral3ForConditionalGeneration's text part as GGUF architecture
"mistral3", Llama's layout: Mistral Small 3.1/3.2's files (no YaRN, no temperature) load here as
plain Mistral. Ministral 3's (YaRN with `yarn_log_multiplier` and a temperature) are refused for
now: how llama.cpp derives their YaRN and temperature constants from those keys is not checked
here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from genfast.errors import UserError
from genfast.llm.model.config import FamilyArgs
from genfast.llm.model.families.base import Family, family_args
from genfast.llm.model.families.llama import attention_bias_fields
from genfast.llm.model.layers import Attention, TransformerBlock

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs


@dataclass(frozen=True)
class TemperatureArgs(FamilyArgs):
    beta: float = 0.0  # 0: no scaling
    original_context: int = 16384  # the positions per step of the scale


class TemperatureAttention(Attention):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        own = family_args(args, TemperatureArgs)
        self.beta, self.original_context = own.beta, own.original_context

    def rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        q, k = super().rotate(q, k, cos, sin, input_pos)
        if not self.beta:
            return q, k
        # As transformers: computed in fp32 from the positions, then cast to the queries' dtype.
        scale = 1 + self.beta * torch.log(1 + torch.floor(input_pos / self.original_context))
        scale = scale[:, None, :, None] if input_pos.dim() == 2 else scale[None, None, :, None]  # [B, 1, S, 1]
        return q * scale.to(q.dtype), k


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = float(rope.get("llama_4_scaling_beta") or 0.0)
    original = int(rope.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 16384))
    return {**attention_bias_fields(cfg), "family_args": TemperatureArgs(beta, original)}


def gguf_fields(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    if meta.get(f"{arch}.attention.temperature_scale") or meta.get(f"{arch}.rope.scaling.type") == "yarn":
        raise UserError(
            "this GGUF is a Ministral 3 (YaRN with an attention temperature), which genfast reads from its "
            "Hugging Face checkpoint only for now"
        )
    return {"family_args": TemperatureArgs()}


def block(args: ModelArgs, i: int) -> TransformerBlock:
    return TransformerBlock(args, TemperatureAttention, moe=args.is_moe_layer(i))


FAMILY = Family(
    "ministral3",
    ("ministral3",),
    ("mistral3",),
    hf_fields,
    block=block,
    gguf_fields=gguf_fields,
    gguf_rope_interleaved=True,  # llama.cpp converts it as Llama, permuting q/k rows
    sliding_window_by_default=True,  # as Mistral: a config's window applies to every layer
    args_type=TemperatureArgs,
)
