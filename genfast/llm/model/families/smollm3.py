"""SmolLM3: Llama's blocks, but some layers attend without rotary positions (NoPE). Its config
lists them (`no_rope_layers`: 1 where a layer rotates, 0 where it does not) or gives an interval
(`no_rope_layer_interval`, default 4: every fourth layer, 1-based, has no rotation). GGUF files
store neither; llama.cpp fixes the interval at 4, and so does the GGUF reader here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from genfast.llm.model.config import FamilyArgs
from genfast.llm.model.families.base import Family, family_args
from genfast.llm.model.families.llama import attention_bias_fields
from genfast.llm.model.layers import Attention, TransformerBlock

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs

NOPE_INTERVAL = 4  # what transformers defaults to and llama.cpp assumes for GGUF files


@dataclass(frozen=True)
class NoPEArgs(FamilyArgs):
    nope_layers: tuple[int, ...]  # the layers whose q and k are not rotated


class NoPEAttention(Attention):
    """Attention with no position information in q and k (causality alone orders the tokens)."""

    def rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        return q, k


def every_nth_layer(n_layers: int, interval: int) -> tuple[int, ...]:
    """Layers i with (i + 1) % interval == 0: the last of each group of `interval`."""
    return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    rotates = cfg.get("no_rope_layers")  # despite its name, 1 marks a layer *with* rotation
    if rotates is None:
        nope = every_nth_layer(cfg["num_hidden_layers"], int(cfg.get("no_rope_layer_interval") or NOPE_INTERVAL))
    else:
        nope = tuple(i for i, r in enumerate(rotates) if not r)
    return {**attention_bias_fields(cfg), "family_args": NoPEArgs(nope)}


def gguf_fields(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    return {"family_args": NoPEArgs(every_nth_layer(int(meta[f"{arch}.block_count"]), NOPE_INTERVAL))}


def block(args: ModelArgs, i: int) -> TransformerBlock:
    nope = i in family_args(args, NoPEArgs).nope_layers
    return TransformerBlock(args, NoPEAttention if nope else Attention, moe=args.is_moe_layer(i))


FAMILY = Family(
    "smollm3",
    ("smollm3",),
    ("smollm3",),
    hf_fields,
    block=block,
    gguf_fields=gguf_fields,
    gguf_rope_interleaved=True,  # llama.cpp converts it as Llama, permuting q/k rows
    args_type=NoPEArgs,
)
