"""What a decoder family declares (see genfast/llm/model/families/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from torch import Tensor, nn

from genfast.llm.model.config import FamilyArgs
from genfast.llm.model.layers import RMSNorm, TransformerBlock

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs


A = TypeVar("A", bound=FamilyArgs)


def family_args(args: ModelArgs, kind: type[A]) -> A:
    """`args.family_args` as the family's own type; a model built from another family's args is a bug."""
    own = args.family_args
    if not isinstance(own, kind):
        raise TypeError(f"a {args.family} model needs {kind.__name__} in ModelArgs.family_args, got {own!r}")
    return own


def _unchanged(args: ModelArgs, x: Tensor) -> Tensor:
    return x


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    # ModelArgs fields that the family sets from a Hugging Face config (beyond the shared ones).
    hf_fields: Callable[[dict[str, Any]], dict[str, Any]] = lambda cfg: {}
    # The block of layer i (the shared pre-norm block unless the family differs; its MLP a mixture
    # of experts where the config has them).
    block: Callable[[ModelArgs, int], nn.Module] = lambda args, i: TransformerBlock(args, moe=args.is_moe_layer(i))
    norm: type[nn.Module] = RMSNorm  # the final norm
    # genfast parameter suffix in a block -> the family's own source tensors (HF, GGUF).
    hf_layer_tensors: dict[str, list[str]] = field(default_factory=dict)
    gguf_layer_tensors: dict[str, list[str]] = field(default_factory=dict)
    # Sources that older GGUF files hold instead of gguf_layer_tensors' (genfast suffix -> names).
    gguf_older_layer_tensors: dict[str, list[str]] = field(default_factory=dict)
    # The same for a mixture-of-experts MLP in HF checkpoints, which store a tensor per expert
    # ("{e}"); GGUF files stack them under names shared by all families (genfast.llm.checkpoints.weights).
    hf_expert_tensors: dict[str, list[str]] = field(default_factory=dict)
    # ModelArgs fields that the family reads from GGUF metadata (beyond the shared ones), given
    # the metadata, its architecture and the file's tensor names.
    gguf_fields: Callable[[dict[str, Any], str, set[str]], dict[str, Any]] = lambda meta, arch, names: {}
    # A GGUF tensor as llama.cpp stores it -> as the model takes it (name: the GGUF tensor's).
    gguf_tensor: Callable[[str, Tensor], Tensor] = lambda name, tensor: tensor
    # A parameter as assembled from its source tensors (fused parts joined) -> as the model takes
    # it, given the model's args, the checkpoint's format ("hf" or "gguf") and the parameter's
    # genfast name (DeepSeek's kv_b split per head; gpt-oss's transposed HF expert stacks). Also
    # applied to a tensor of row numbers, to put an HF MXFP4 stack's rows in the model's order.
    load_tensor: Callable[[ModelArgs, str, str, Tensor], Tensor] = lambda args, fmt, name, tensor: tensor
    # The q/k rows of a head are in interleaved rotary pairs, not halves: in GGUF files (llama.cpp's
    # converter permutes Llama's rows so; ERNIE's are so already), in HF checkpoints (ERNIE 4.5).
    gguf_rope_interleaved: bool = False
    hf_rope_interleaved: bool = False
    # A config's `sliding_window` applies to every layer unless it says `use_sliding_window: false`
    # (Mistral, Phi-3); otherwise only when it says true, and then to some layers (Qwen2/3).
    sliding_window_by_default: bool = False
    # The type of ModelArgs.family_args for this family (None: it has no values of its own); a
    # saved config's family_args are read back into it.
    args_type: type[FamilyArgs] | None = None
    # The shared model's hooks, given the model's args: the embeddings before the first block, and
    # the fp32 logits after the output head (as the model returns them).
    scale_embeddings: Callable[[ModelArgs, Tensor], Tensor] = _unchanged
    final_logits: Callable[[ModelArgs, Tensor], Tensor] = _unchanged
    # Why the family's blocks cannot be sharded by genfast.llm.tensor_parallel (None: they can):
    # the one place a family refuses --tp (check_shardable says it before any rank starts; heads
    # and widths that do not divide by the ranks are checked per model there too).
    not_shardable: str | None = None


# Per-head q/k norm weights (Qwen3, Gemma 3): genfast's names -> the checkpoints' (HF, GGUF).
QK_NORM_HF_TENSORS = {
    "attention.q_norm.weight": ["self_attn.q_norm.weight"],
    "attention.k_norm.weight": ["self_attn.k_norm.weight"],
}
QK_NORM_GGUF_TENSORS = {
    "attention.q_norm.weight": ["attn_q_norm.weight"],
    "attention.k_norm.weight": ["attn_k_norm.weight"],
}
