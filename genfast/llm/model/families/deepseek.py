"""DeepSeek-V3 / R1 and Kimi K2 (model_type deepseek_v3; GGUF architecture deepseek2, which
llama.cpp uses for V2 and V3): multi-head latent attention (MLA) and a mixture of shared and
group-routed experts after `first_k_dense_replace` dense layers.

MLA projects each position to a latent of kv_lora_rank, normalized, plus one rotary key of
qk_rope_head_dim shared by all heads; kv_b_proj expands the latent into per-head keys (nope part)
and values. The cache keeps only latent and shared key (`LatentKVCache`), so a decode step reads
kv_lora_rank + qk_rope_head_dim values per position and layer instead of per-head keys and
values. Decode runs "absorbed": the key half of kv_b_proj is folded into the query and its value
half applied after attention, so attention runs over the latents directly; a call of several
queries (prefill, speculative verification) expands the latents into keys and values instead,
cheaper when the queries are many.

The checkpoints' rotary rows are in interleaved pairs (transformers' `rope_interleave`, and
llama.cpp's converter keeps them so); they are reordered on loading to the rotate-half layout the
shared `apply_rope` uses, which leaves every q·k product unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.errors import UserError
from genfast.llm.model.config import FamilyArgs, RopeScaling, yarn_mscale
from genfast.llm.model.families.base import Family, family_args
from genfast.llm.model.layers import FeedForward, LatentKVCache, RMSNorm, TransformerBlock, apply_rope
from genfast.llm.model.moe import GroupLimitedRouter, MoEFeedForward
from genfast.nn import Linear

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs

LATENT_NORM_EPS = 1e-6  # transformers' q_a/kv_a layernorms take their default eps, not the config's


@dataclass(frozen=True, kw_only=True)
class SharedExpertArgs(FamilyArgs):
    """DeepSeek's mixture beyond the shared ModelArgs (also GLM-4.5's: families/glm4_moe.py)."""

    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1


@dataclass(frozen=True, kw_only=True)
class DeepseekArgs(SharedExpertArgs):
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q projection (DeepSeek-V2-Lite)
    attention_bias: bool = False  # on q_a/kv_a and the output projection
    rope_interleave: bool = True  # the checkpoint's rotary rows in interleaved pairs


def softmax_scale(args: ModelArgs) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale squared where the rope scaling says mscale_all_dim."""
    own = family_args(args, DeepseekArgs)
    scale = (own.qk_nope_head_dim + own.qk_rope_head_dim) ** -0.5
    rs = args.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


class LatentAttention(nn.Module):
    """Multi-head latent attention over a `LatentKVCache` (see the module doc). Its interface is
    the shared Attention's: forward, kv_cache, new_cache."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        own = family_args(args, DeepseekArgs)
        self.n_heads, self.sliding_window = args.n_heads, None
        self.rank, self.nope, self.rope, self.v_dim = (
            own.kv_lora_rank,
            own.qk_nope_head_dim,
            own.qk_rope_head_dim,
            own.v_head_dim,
        )
        q_out = args.n_heads * (self.nope + self.rope)
        if own.q_lora_rank is None:
            self.wq = Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = Linear(args.dim, own.q_lora_rank, bias=own.attention_bias)
            self.q_norm = RMSNorm(own.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = Linear(own.q_lora_rank, q_out, bias=False)
        self.wkv_a = Linear(args.dim, self.rank + self.rope, bias=own.attention_bias)  # latent ‖ shared rope key
        self.kv_norm = RMSNorm(self.rank, LATENT_NORM_EPS)
        # kv_b_proj per head: key (nope) rows, then value rows. A plain tensor, not a Linear: the
        # absorbed decode multiplies by its halves directly. int8/int4 leave it in float, for
        # three reasons. Its key half is contracted over nope in the absorbed decode (the query
        # into the latent) but over the rank in the expanded prefill, and a per-output-channel
        # quantized layout serves one contraction only. genfast's quantized kernels are linears
        # over one weight; these are H per-head products per half (as expert stacks: a kernel
        # call per head, 2 * H per layer and token). And it is small: 1.0B of DeepSeek-V3's 37.6B
        # active parameters; in bf16 it adds ~3% to the bytes an int8 decode step reads, ~8% at
        # int4. The stats' bytes per token count it as stored.
        self.wkv_b = nn.Parameter(torch.empty(args.n_heads, self.nope + self.v_dim, self.rank))
        self.wo = Linear(args.n_heads * self.v_dim, args.dim, bias=own.attention_bias)
        self.scale = softmax_scale(args)
        self.kv_cache: LatentKVCache | None = None

    def new_cache(
        self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str | None
    ) -> LatentKVCache:
        return LatentKVCache(batch, max_len, self.rank + self.rope, dtype, device)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, mask: Tensor, cache_rows: Tensor | None = None
    ) -> Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(bsz, seqlen, self.n_heads, -1).transpose(1, 2).split([self.nope, self.rope], -1)
        latent, k_rope = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)
        current = torch.cat([self.kv_norm(latent)[:, None], apply_rope(k_rope[:, None], cos, sin)], dim=-1)
        if self.kv_cache is None:  # attend within this call only
            cached = current
        else:
            cached = self.kv_cache.attend_inputs(input_pos, current, cache_rows, mask.shape[-1])
        cached = cached.to(q.dtype)  # a bf16 cache under fp32 compute
        if seqlen == 1:
            out = self.attend_absorbed(q_nope, q_rope, cached, mask)
        else:
            out = self.attend_expanded(q_nope, q_rope, cached, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.v_dim))

    def attend_absorbed(self, q_nope: Tensor, q_rope: Tensor, cached: Tensor, mask: Tensor) -> Tensor:
        """Attention over the latents [B, 1, L, rank + rope]: queries [B, H, S, *] taken into the
        latent space through kv_b's key half, the latent output out through its value half."""
        w_key, w_value = self.wkv_b.to(q_nope.dtype).split([self.nope, self.v_dim], dim=1)
        q = torch.cat([q_nope @ w_key, q_rope], dim=-1)  # [B, H, S, rank + rope]
        scores = (q @ cached.transpose(-1, -2)).float() * self.scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
        return (probs @ cached[..., : self.rank]) @ w_value.transpose(1, 2)  # [B, H, S, v_dim]

    def attend_expanded(self, q_nope: Tensor, q_rope: Tensor, cached: Tensor, mask: Tensor) -> Tensor:
        """Attention over per-head keys and values expanded from the latents."""
        latent, k_rope = cached.split([self.rank, self.rope], dim=-1)
        k_nope, values = (latent @ self.wkv_b.to(latent.dtype).transpose(1, 2)).split([self.nope, self.v_dim], -1)
        keys = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)


class SharedExpertMoE(MoEFeedForward):
    """Routed experts (group-limited sigmoid routing) plus shared experts every token runs: one
    gated MLP of n_shared_experts times the experts' width."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        own = family_args(args, SharedExpertArgs)
        self.router = GroupLimitedRouter(
            args.dim,
            args.n_experts,
            args.n_active_experts,
            args.normalize_expert_weights,
            own.n_group,
            own.topk_group,
            own.routed_scaling_factor,
        )
        width = args.expert_intermediate_size * own.n_shared_experts
        self.shared = FeedForward(dataclasses.replace(args, intermediate_size=width)) if width else None

    def forward(self, x: Tensor) -> Tensor:
        routed = super().forward(x)
        return routed if self.shared is None else routed + self.shared(x)


def block(args: ModelArgs, i: int) -> TransformerBlock:
    return TransformerBlock(args, LatentAttention, moe=args.is_moe_layer(i), moe_type=SharedExpertMoE)


def _deinterleaved_rows(w: Tensor, rope: int, per: int) -> Tensor:
    """Rows (or a bias) in groups of `per` whose last `rope` are interleaved rotary pairs, with
    those reordered to the rotate-half layout (even members, then odd ones)."""
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) + (per - rope)
    order = torch.cat([torch.arange(per - rope), order])
    groups = w.reshape(-1, per, *w.shape[1:])
    return groups[:, order].reshape(w.shape)


def load_tensor(args: ModelArgs, fmt: str, name: str, tensor: Tensor) -> Tensor:
    """A parameter as assembled from the checkpoint (either format) -> as the model takes it:
    rotary rows of q and of the shared key de-interleaved, kv_b_proj per head (from HF's or older
    GGUFs' 2-D tensor, or the [H, nope + v, rank] that the split GGUF tensors assemble into)."""
    own = family_args(args, DeepseekArgs)
    if name.endswith("attention.wkv_b"):
        return tensor.reshape(args.n_heads, own.qk_nope_head_dim + own.v_head_dim, own.kv_lora_rank)
    if own.rope_interleave:
        if name.endswith(("attention.wq.weight", "attention.wq_b.weight")):
            return _deinterleaved_rows(tensor, own.qk_rope_head_dim, own.qk_nope_head_dim + own.qk_rope_head_dim)
        if name.endswith(("attention.wkv_a.weight", "attention.wkv_a.bias")):
            return _deinterleaved_rows(tensor, own.qk_rope_head_dim, own.kv_lora_rank + own.qk_rope_head_dim)
    return tensor


def hf_shared_expert_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture's ModelArgs fields and SharedExpertArgs values (as keyword arguments) of a
    DeepSeek-style HF config."""
    n_experts, n_layers = int(cfg.get("n_routed_experts") or 0), int(cfg["num_hidden_layers"])
    fields = {
        "n_experts": n_experts,
        "n_active_experts": int(cfg.get("num_experts_per_tok") or 0) if n_experts else 0,
        "expert_intermediate_size": int(cfg.get("moe_intermediate_size") or 0),
        "normalize_expert_weights": bool(cfg.get("norm_topk_prob", True)),
        "dense_layers": tuple(range(min(int(cfg.get("first_k_dense_replace") or 0), n_layers))),
    }
    own = {
        "n_shared_experts": int(cfg.get("n_shared_experts") or 0),
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
        "n_group": int(cfg.get("n_group") or 1),
        "topk_group": int(cfg.get("topk_group") or 1),
    }
    return {**fields, "family_args": own}


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = int(cfg["qk_rope_head_dim"])
    fields = hf_shared_expert_fields(cfg)
    own = DeepseekArgs(
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=rope,
        v_head_dim=int(cfg["v_head_dim"]),
        q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        **fields["family_args"],
    )
    return {
        **fields,
        "head_dim": rope,  # the rotary part: what the model's rope tables are built for
        "rotary_dim": rope,
        "n_kv_heads": int(cfg["num_attention_heads"]),
        "qkv_bias": False,
        "out_bias": own.attention_bias,
        "family_args": own,
    }


SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def gguf_shared_expert_values(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """SharedExpertArgs values (as keyword arguments) from llama.cpp's keys; softmax routing refused."""
    gating = int(meta.get(f"{arch}.expert_gating_func", SIGMOID_GATING))
    if meta.get(f"{arch}.expert_count") and gating != SIGMOID_GATING:
        raise UserError(
            f"this {arch} GGUF routes its experts by softmax (as DeepSeek-V2); genfast loads sigmoid-routed "
            "experts only (DeepSeek-V3's)"
        )
    return {
        "n_shared_experts": int(meta.get(f"{arch}.expert_shared_count", 0) or 0),
        "routed_scaling_factor": float(meta.get(f"{arch}.expert_weights_scale", 1.0) or 1.0),
        "n_group": int(meta.get(f"{arch}.expert_group_count", 1) or 1),
        "topk_group": int(meta.get(f"{arch}.expert_group_used_count", 1) or 1),
    }


def gguf_fields(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """llama.cpp's deepseek2 keys. Files from recent converters store the attention as MQA over
    the latent (key_length = kv_lora_rank + rope, the per-head sizes in key/value_length_mla);
    older ones give the per-head sizes in key/value_length."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UserError(f"corrupt GGUF: metadata key {arch}.{name} is missing")
        return value

    rope = int(key("rope.dimension_count"))
    key_length = int(meta.get(f"{arch}.attention.key_length_mla") or key("attention.key_length"))
    value_length = int(meta.get(f"{arch}.attention.value_length_mla") or key("attention.value_length"))
    q_lora = int(meta.get(f"{arch}.attention.q_lora_rank", 0) or 0)
    own = DeepseekArgs(
        kv_lora_rank=int(key("attention.kv_lora_rank")),
        qk_nope_head_dim=key_length - rope,
        qk_rope_head_dim=rope,
        v_head_dim=value_length,
        q_lora_rank=q_lora or None,
        rope_interleave=True,  # llama.cpp rotates deepseek2's pairs in place (its NORM rope)
        **gguf_shared_expert_values(meta, arch),
    )
    fields: dict[str, Any] = {
        "head_dim": rope,
        "rotary_dim": rope,
        "n_kv_heads": int(key("attention.head_count")),
        "family_args": own,
    }
    if meta.get(f"{arch}.rope.scaling.type") == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim as its log multiplier, and (as DeepSeek's configs,
        # mscale = mscale_all_dim) leaves cos and sin unscaled.
        fields["rope_scaling"] = RopeScaling(
            "yarn",
            float(key("rope.scaling.factor")),
            original_max_position_embeddings=int(key("rope.scaling.original_context_length")),
            beta_fast=float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            mscale_all_dim=float(meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1,
        )
    return fields


def from_gguf(name: str, tensor: Tensor) -> Tensor:
    """llama.cpp's converter stores kv_b's key half transposed per head ([H, rank, nope])."""
    return tensor.transpose(1, 2) if name.endswith("attn_k_b.weight") else tensor


# The mixture's tensors, shared with GLM-4.5 (genfast names -> the checkpoints').
SHARED_EXPERT_HF_TENSORS = {
    "feed_forward.shared.w13.weight": ["mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"],
    "feed_forward.shared.w2.weight": ["mlp.shared_experts.down_proj.weight"],
    "feed_forward.router.correction_bias": ["mlp.gate.e_score_correction_bias"],
}
SHARED_EXPERT_GGUF_TENSORS = {
    "feed_forward.shared.w13.weight": ["ffn_gate_shexp.weight", "ffn_up_shexp.weight"],
    "feed_forward.shared.w2.weight": ["ffn_down_shexp.weight"],
    "feed_forward.router.correction_bias": ["exp_probs_b.bias"],
}
EXPERT_HF_TENSORS = {
    "feed_forward.router.weight": ["mlp.gate.weight"],
    "feed_forward.w13.weight": ["mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"],
    "feed_forward.w2.weight": ["mlp.experts.{e}.down_proj.weight"],
}

FAMILY = Family(
    "deepseek_v3",
    ("deepseek_v3",),
    ("deepseek2",),
    hf_fields,
    block=block,
    hf_layer_tensors={
        "attention.wq.weight": ["self_attn.q_proj.weight"],
        "attention.wq_a.weight": ["self_attn.q_a_proj.weight"],
        "attention.wq_a.bias": ["self_attn.q_a_proj.bias"],
        "attention.q_norm.weight": ["self_attn.q_a_layernorm.weight"],
        "attention.wq_b.weight": ["self_attn.q_b_proj.weight"],
        "attention.wkv_a.weight": ["self_attn.kv_a_proj_with_mqa.weight"],
        "attention.wkv_a.bias": ["self_attn.kv_a_proj_with_mqa.bias"],
        "attention.kv_norm.weight": ["self_attn.kv_a_layernorm.weight"],
        "attention.wkv_b": ["self_attn.kv_b_proj.weight"],
        **SHARED_EXPERT_HF_TENSORS,
    },
    gguf_layer_tensors={
        "attention.wq.weight": ["attn_q.weight"],
        "attention.wq_a.weight": ["attn_q_a.weight"],
        "attention.q_norm.weight": ["attn_q_a_norm.weight"],
        "attention.wq_b.weight": ["attn_q_b.weight"],
        "attention.wkv_a.weight": ["attn_kv_a_mqa.weight"],
        "attention.kv_norm.weight": ["attn_kv_a_norm.weight"],
        "attention.wkv_b": ["attn_k_b.weight", "attn_v_b.weight"],
        **SHARED_EXPERT_GGUF_TENSORS,
    },
    gguf_older_layer_tensors={"attention.wkv_b": ["attn_kv_b.weight"]},  # kv_b whole, as HF's
    hf_expert_tensors=EXPERT_HF_TENSORS,
    gguf_fields=gguf_fields,
    gguf_tensor=from_gguf,
    load_tensor=load_tensor,
    args_type=DeepseekArgs,
    not_shardable="latent attention and shared experts are not sharded",
)
