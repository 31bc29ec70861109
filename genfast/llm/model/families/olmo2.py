"""OLMo 2 and 3: norms after attention and after the MLP (on their outputs, before the residual
add; no norm on a block's input), and q and k each RMS-normalized over the whole projection (all
heads together, one weight of heads * head_dim) before the rotary embedding. OLMo 3 adds
sliding-window attention on some layers (its `layer_types`; three of every four by default).
llama.cpp writes both as GGUF architecture "olmo2", OLMo 3's window and layer pattern as keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from genfast.errors import UserError
from genfast.llm.model.config import FamilyArgs
from genfast.llm.model.families.base import QK_NORM_GGUF_TENSORS, QK_NORM_HF_TENSORS, Family, family_args
from genfast.llm.model.families.llama import attention_bias_fields
from genfast.llm.model.layers import Attention, FeedForward, RMSNorm

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs


@dataclass(frozen=True)
class SlidingLayersArgs(FamilyArgs):
    sliding_window: int | None = None  # the local layers' window
    sliding_layers: tuple[int, ...] = ()  # the local layers (none in OLMo 2)


class WideQKNormAttention(Attention):
    """q and k normalized over all heads together (the family's not_shardable says what that
    means for tensor parallelism)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.q_norm = RMSNorm(args.n_heads * args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.n_kv_heads * args.head_dim, args.norm_eps)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.projections(x)
        return self.heads(self.q_norm(q)), self.heads(self.k_norm(k)), self.heads(v)


class PostNormBlock(nn.Module):
    """x + norm(attention(x)), then h + norm(mlp(h)); the attribute names of the shared block
    (attention, feed_forward), so quantization and sharding apply."""

    def __init__(self, args: ModelArgs, attention: Attention) -> None:
        super().__init__()
        self.attention = attention
        self.feed_forward = FeedForward(args)
        self.post_attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.post_ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, mask: Tensor, cache_rows: Tensor | None = None
    ) -> Tensor:
        h = x + self.post_attention_norm(self.attention(x, cos, sin, input_pos, mask, cache_rows))
        return h + self.post_ffn_norm(self.feed_forward(h))


def sliding_layer_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The local layers a HF config's `layer_types` names, and their window."""
    local = tuple(i for i, t in enumerate(cfg.get("layer_types") or ()) if t == "sliding_attention")
    if not local:
        return {"family_args": SlidingLayersArgs()}
    rope = cfg.get("rope_parameters") or {}
    if "sliding_attention" in rope and rope["sliding_attention"] != rope.get("full_attention"):
        raise UserError(
            f"{cfg['model_type']} with local layers that rotate apart from the global ones is not supported"
        )
    return {"family_args": SlidingLayersArgs(int(cfg["sliding_window"]), local)}


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**attention_bias_fields(cfg), **sliding_layer_fields(cfg)}


def gguf_fields(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """llama.cpp's converter writes a window and a per-layer pattern (True: local) for OLMo 3."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    window = meta.get(f"{arch}.attention.sliding_window")
    if not window or not pattern:
        return {"family_args": SlidingLayersArgs()}
    return {"family_args": SlidingLayersArgs(int(window), tuple(i for i, local in enumerate(pattern) if local))}


def block(args: ModelArgs, i: int) -> PostNormBlock:
    attention = WideQKNormAttention(args)
    own = family_args(args, SlidingLayersArgs)
    if i in own.sliding_layers:
        attention.sliding_window = own.sliding_window
    return PostNormBlock(args, attention)


# The post-norms: genfast's names -> the checkpoints' (HF, GGUF); OLMo 2's `post_attention_layernorm`
# is a post-norm, not the pre-MLP norm it is in Llama.
POST_NORM_HF_TENSORS = {
    "post_attention_norm.weight": ["post_attention_layernorm.weight"],
    "post_ffn_norm.weight": ["post_feedforward_layernorm.weight"],
}
POST_NORM_GGUF_TENSORS = {
    "post_attention_norm.weight": ["post_attention_norm.weight"],
    "post_ffn_norm.weight": ["post_ffw_norm.weight"],
}

FAMILY = Family(
    "olmo2",
    ("olmo2", "olmo3"),
    ("olmo2",),
    hf_fields,
    block=block,
    hf_layer_tensors={**POST_NORM_HF_TENSORS, **QK_NORM_HF_TENSORS},
    gguf_layer_tensors={**POST_NORM_GGUF_TENSORS, **QK_NORM_GGUF_TENSORS},
    gguf_fields=gguf_fields,
    args_type=SlidingLayersArgs,
    not_shardable="their q and k norms span all heads together, which a rank holding some of the heads cannot apply",
)
