"""IBM Granite (3.x dense): Llama's blocks with four scalars of its own: embeddings times
`embedding_multiplier`, attention scores scaled by `attention_multiplier` (not 1/sqrt(head_dim)),
each block's attention and MLP outputs times `residual_multiplier` before they are added, and
the logits divided by `logits_scaling`. GGUF files name them embedding_scale, attention.scale,
residual_scale and logit_scale (llama.cpp's converter writes each where it is set)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from genfast.llm.model.config import FamilyArgs
from genfast.llm.model.families.base import Family, family_args
from genfast.llm.model.families.llama import attention_bias_fields
from genfast.llm.model.layers import TransformerBlock

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs


@dataclass(frozen=True)
class GraniteArgs(FamilyArgs):
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None  # None: 1/sqrt(head_dim)
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


class GraniteBlock(TransformerBlock):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        own = family_args(args, GraniteArgs)
        if own.attention_multiplier is not None:
            self.attention.scale = own.attention_multiplier
        self.residual_multiplier = own.residual_multiplier

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, mask: Tensor, cache_rows: Tensor | None = None
    ) -> Tensor:
        attended = self.attention(self.attention_norm(x), cos, sin, input_pos, mask, cache_rows)
        h = x + attended * self.residual_multiplier
        return h + self.feed_forward(self.ffn_norm(h)) * self.residual_multiplier


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    own = GraniteArgs(
        float(cfg.get("embedding_multiplier", 1.0)),
        float(cfg["attention_multiplier"]) if cfg.get("attention_multiplier") is not None else None,
        float(cfg.get("residual_multiplier", 1.0)),
        float(cfg.get("logits_scaling", 1.0)),
    )
    return {**attention_bias_fields(cfg), "family_args": own}


def gguf_fields(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """A scale the file lacks (or gives as 0) is the default, as llama.cpp reads them."""

    def scale(key: str) -> float | None:
        return float(meta[f"{arch}.{key}"]) if meta.get(f"{arch}.{key}") else None

    own = GraniteArgs(
        scale("embedding_scale") or 1.0,
        scale("attention.scale"),
        scale("residual_scale") or 1.0,
        scale("logit_scale") or 1.0,
    )
    return {"family_args": own}


def scale_embeddings(args: ModelArgs, x: Tensor) -> Tensor:
    return x * family_args(args, GraniteArgs).embedding_multiplier


def scale_logits(args: ModelArgs, logits: Tensor) -> Tensor:
    return logits / family_args(args, GraniteArgs).logits_scaling


FAMILY = Family(
    "granite",
    ("granite",),
    ("granite",),
    hf_fields,
    block=lambda args, i: GraniteBlock(args),
    gguf_fields=gguf_fields,
    gguf_rope_interleaved=True,  # llama.cpp converts it as Llama, permuting q/k rows
    args_type=GraniteArgs,
    scale_embeddings=scale_embeddings,
    final_logits=scale_logits,
)
