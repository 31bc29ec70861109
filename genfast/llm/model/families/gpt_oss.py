"""gpt-oss (OpenAI's open-weight mixtures; model_type gpt_oss, GGUF architecture gpt-oss).

What differs from the shared blocks (genfast/llm/model/layers.py, moe.py):
- attention has biases on q, k, v and o, and a learned logit per head, the attention sink: an
  extra entry in each query's softmax that takes probability mass and contributes no value;
- layers alternate between a sliding window (128 tokens; its cache a ring, WindowKVCache) and
  full attention, as the config's `layer_types` say;
- rope is YaRN (genfast.llm.model.config.yarn_inverse_frequencies), its cos and sin scaled by
  the rope's attention factor;
- the router has a bias, and its weights are the softmax over the chosen experts' logits (what
  the shared router computes with renormalization);
- experts have biases and a clamped SwiGLU: gate clamped above and up on both sides at `limit`,
  (up + 1) * gate * sigmoid(alpha * gate). Hugging Face stores gate and up interleaved (column
  2j gate, 2j + 1 up) and its stacks transposed ([E, in, out]); loading puts them in genfast's
  gate ‖ up, [E, out, in] layout. Published checkpoints keep the experts in MXFP4 (e2m1 values,
  e8m0 scales per 32), which loading reads (genfast.llm.checkpoints.weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.llm.model.config import FamilyArgs, RopeScaling, yarn_attention_factor
from genfast.llm.model.families.base import Family, family_args
from genfast.llm.model.layers import Attention, TransformerBlock
from genfast.llm.model.moe import MoEFeedForward

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs

DEFAULT_WINDOW = 128
# The published models' expert activation (their config's swiglu_alpha and swiglu_limit).
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class GptOssArgs(FamilyArgs):
    sliding_window: int  # the window of the sliding layers
    sliding_layers: tuple[int, ...]
    swiglu_alpha: float = SWIGLU_ALPHA
    swiglu_limit: float = SWIGLU_LIMIT


def attention_with_sinks(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """softmax over [scale * q k^T (masked), sink of the head] for each query, the sink's share
    dropped, times v. q [B, H, S, D], keys and values [B, KV, L, D] (grouped heads), mask boolean
    [B|1, 1, S, L], sinks [H]: [B, H, S, D] in q's dtype.

    One query per sequence (decode): scores and softmax explicitly, grouped by KV head, in fp32;
    the native decode kernel (genfast/kernels/decode_attention) has no sink and is not used. More
    queries (prefill, verification): SDPA, the sink as one more key column whose key is zero (so
    its score is the additive mask's value there, the sink) and whose value is zero."""
    bsz, heads, seqlen, hd = q.shape
    kv_heads = keys.shape[1]
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a bf16 cache under fp32 compute
    if seqlen == 1:
        group = heads // kv_heads
        scores = (q.reshape(bsz, kv_heads, group, hd) @ keys.transpose(2, 3)).float() * scale  # [B, KV, G, L]
        scores = scores.masked_fill(~mask, float("-inf"))  # mask [B|1, 1, 1, L] over [B, KV, G, L]
        sink = sinks.float().view(1, kv_heads, group, 1).expand(bsz, -1, -1, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        return (probs.to(values.dtype) @ values).view(bsz, heads, 1, hd)
    zero = keys.new_zeros(bsz, kv_heads, 1, hd)
    keys, values = torch.cat([keys, zero], dim=2), torch.cat([values, zero], dim=2)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    bias = bias.expand(-1, heads, -1, -1)
    sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(bias.shape[0], -1, seqlen, 1)
    bias = torch.cat([bias, sink], dim=-1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale, enable_gqa=True)


class GptOssAttention(Attention):
    def __init__(self, args: ModelArgs, sliding: bool) -> None:
        super().__init__(args)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))
        self.sliding_window = family_args(args, GptOssArgs).sliding_window if sliding else None

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        return attention_with_sinks(q, keys, values, mask, self.sinks, self.head_dim**-0.5)


class GptOssExperts(MoEFeedForward):
    """The mixture with a biased router, expert biases (added per row, by its expert: the stacks
    `w13` and `w2` stay plain ExpertLinears, quantizable and MXFP4-loadable) and the clamped SwiGLU."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, router_bias=True)
        own = family_args(args, GptOssArgs)
        self.alpha, self.limit = own.swiglu_alpha, own.swiglu_limit
        self.w13_bias = nn.Parameter(torch.empty(args.n_experts, 2 * args.expert_intermediate_size))  # gate ‖ up
        self.w2_bias = nn.Parameter(torch.empty(args.n_experts, args.dim))

    def expert_tensors(self) -> list[Tensor]:
        return [*super().expert_tensors(), self.w13_bias, self.w2_bias]

    def experts(self, rows: Tensor, per_row: Tensor) -> Tensor:
        gate_up = self.w13(rows, per_row) + self.w13_bias[per_row].to(rows.dtype)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        hidden = (up + 1) * gate * torch.sigmoid(self.alpha * gate)
        return self.w2(hidden, per_row) + self.w2_bias[per_row].to(rows.dtype)


def block(args: ModelArgs, layer: int) -> TransformerBlock:
    """The shared pre-norm block with gpt-oss's attention (sliding or full) and experts in every layer."""
    sliding = layer in family_args(args, GptOssArgs).sliding_layers
    return TransformerBlock(args, partial(GptOssAttention, sliding=sliding), moe=True, moe_type=GptOssExperts)


def alternating_sliding_layers(n_layers: int) -> tuple[int, ...]:
    """The published models' pattern (and llama.cpp's for GGUF): even layers sliding, odd ones full."""
    return tuple(range(0, n_layers, 2))


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    types = cfg.get("layer_types")
    n_layers = cfg["num_hidden_layers"]
    sliding = (
        tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if types
        else alternating_sliding_layers(n_layers)
    )
    own = GptOssArgs(
        sliding_window=int(cfg.get("sliding_window") or DEFAULT_WINDOW),
        sliding_layers=sliding,
        swiglu_alpha=float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)),
        swiglu_limit=float(cfg.get("swiglu_limit", SWIGLU_LIMIT)),
    )
    bias = bool(cfg.get("attention_bias", True))
    return {
        "qkv_bias": bias,
        "out_bias": bias,
        "n_experts": int(cfg["num_local_experts"]),
        "n_active_experts": int(cfg["num_experts_per_tok"]),
        "expert_intermediate_size": int(cfg["intermediate_size"]),
        "normalize_expert_weights": True,  # the softmax over the top-k logits
        "family_args": own,
    }


def gguf_fields(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """GGUF stores neither the layer pattern nor YaRN's ramp settings: llama.cpp's pattern
    (alternating, sliding first) and the published config's YaRN (beta 32 and 1, the ramp's ends
    not rounded; llama.cpp rounds them for every model, genfast computes as transformers does)."""
    n_layers = int(meta[f"{arch}.block_count"])
    own = GptOssArgs(
        sliding_window=int(meta.get(f"{arch}.attention.sliding_window", DEFAULT_WINDOW)),
        sliding_layers=alternating_sliding_layers(n_layers),
    )
    fields: dict[str, Any] = {"family_args": own}
    if meta.get(f"{arch}.rope.scaling.type") == "yarn":
        factor = float(meta[f"{arch}.rope.scaling.factor"])
        fields["rope_scaling"] = RopeScaling(
            "yarn",
            factor,
            original_max_position_embeddings=int(meta[f"{arch}.rope.scaling.original_context_length"]),
            attention_factor=yarn_attention_factor(factor),
            truncate=False,
        )
    return fields


def load_tensor(args: ModelArgs, fmt: str, name: str, tensor: Tensor) -> Tensor:
    """transformers' expert stacks ([E, in, out], gate and up interleaved) in genfast's layout
    ([E, out, in], gate ‖ up); GGUF's are so already."""
    if fmt != "hf":
        return tensor
    if name.endswith(("feed_forward.w13.weight", "feed_forward.w2.weight")):
        tensor = tensor.transpose(-1, -2)
    if name.endswith(("feed_forward.w13.weight", "feed_forward.w13_bias")):  # [E, 2I, ...]: gate ‖ up
        return torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
    return tensor


FAMILY = Family(
    "gpt_oss",
    ("gpt_oss",),
    ("gpt-oss",),
    hf_fields,
    block=block,
    hf_layer_tensors={
        "attention.sinks": ["self_attn.sinks"],
        "feed_forward.router.bias": ["mlp.router.bias"],
        "feed_forward.w13_bias": ["mlp.experts.gate_up_proj_bias"],
        "feed_forward.w2_bias": ["mlp.experts.down_proj_bias"],
    },
    hf_expert_tensors={
        "feed_forward.router.weight": ["mlp.router.weight"],
        # Stacked already (no "{e}"); MXFP4 checkpoints store them as _blocks and _scales.
        "feed_forward.w13.weight": ["mlp.experts.gate_up_proj"],
        "feed_forward.w2.weight": ["mlp.experts.down_proj"],
    },
    load_tensor=load_tensor,
    gguf_layer_tensors={
        "attention.sinks": ["attn_sinks.weight"],
        "ffn_norm.weight": ["post_attention_norm.weight"],
        "feed_forward.router.bias": ["ffn_gate_inp.bias"],
        "feed_forward.w13_bias": ["ffn_gate_exps.bias", "ffn_up_exps.bias"],
        "feed_forward.w2_bias": ["ffn_down_exps.bias"],
    },
    gguf_fields=gguf_fields,
    args_type=GptOssArgs,
    not_shardable="their per-head attention sinks, expert biases and MXFP4 experts are not sharded",
)
