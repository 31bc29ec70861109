"""EXAONE 4.0: OLMo 2's post-norm block (genfast/llm/model/families/olmo2.py) with Qwen3's per-head
q/k norms. Where its config has a sliding window (the 32B), the layers its `layer_types` call
sliding (three of every four) attend within the window with rotary positions and the others
attend globally without any (NoPE); without a window (the 1.2B) every layer is global and
rotates. GGUF files store no layer pattern: llama.cpp makes the 64-layer model hybrid (window
4096 unless the file gives one, every fourth layer global) and every other size global."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genfast.llm.model.families.base import QK_NORM_GGUF_TENSORS, QK_NORM_HF_TENSORS, Family, family_args
from genfast.llm.model.families.olmo2 import (
    POST_NORM_GGUF_TENSORS,
    POST_NORM_HF_TENSORS,
    PostNormBlock,
    SlidingLayersArgs,
)
from genfast.llm.model.families.qwen3 import Qwen3Attention
from genfast.llm.model.families.smollm3 import NoPEAttention, every_nth_layer

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs

HYBRID_GGUF_LAYERS = 64  # the one size llama.cpp runs with local layers (EXAONE 4.0 32B)
GGUF_WINDOW = 4096
GLOBAL_EVERY = 4


@dataclass(frozen=True)
class Exaone4Args(SlidingLayersArgs):
    nope_layers: tuple[int, ...] = ()  # the global layers of a hybrid model


class NoPEQwen3Attention(NoPEAttention, Qwen3Attention):
    """Per-head q/k norms and no rotation."""


def _hybrid(n_layers: int, window: int, local: tuple[int, ...]) -> Exaone4Args:
    return Exaone4Args(window, local, tuple(i for i in range(n_layers) if i not in local))


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    n_layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if not window:
        return {"qkv_bias": False, "out_bias": False, "family_args": Exaone4Args()}
    types = cfg.get("layer_types")
    if types:
        local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        local = tuple(sorted(set(range(n_layers)) - set(every_nth_layer(n_layers, GLOBAL_EVERY))))
    return {"qkv_bias": False, "out_bias": False, "family_args": _hybrid(n_layers, int(window), local)}


def gguf_fields(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    n_layers = int(meta[f"{arch}.block_count"])
    if n_layers != HYBRID_GGUF_LAYERS:
        return {"family_args": Exaone4Args()}
    window = int(meta.get(f"{arch}.attention.sliding_window") or GGUF_WINDOW)
    local = tuple(sorted(set(range(n_layers)) - set(every_nth_layer(n_layers, GLOBAL_EVERY))))
    return {"family_args": _hybrid(n_layers, window, local)}


def block(args: ModelArgs, i: int) -> PostNormBlock:
    own = family_args(args, Exaone4Args)
    attention = (NoPEQwen3Attention if i in own.nope_layers else Qwen3Attention)(args)
    if i in own.sliding_layers:
        attention.sliding_window = own.sliding_window
    return PostNormBlock(args, attention)


FAMILY = Family(
    "exaone4",
    ("exaone4",),
    ("exaone4",),
    hf_fields,
    block=block,
    hf_layer_tensors={**POST_NORM_HF_TENSORS, **QK_NORM_HF_TENSORS},
    gguf_layer_tensors={**POST_NORM_GGUF_TENSORS, **QK_NORM_GGUF_TENSORS},
    gguf_fields=gguf_fields,
    args_type=Exaone4Args,
)
