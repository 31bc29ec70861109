"""Model configuration of the decoder families (genfast/llm/model/families/): the values a model is
built from. How a checkpoint's config becomes one: genfast/llm/model/reading.py."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from genfast.errors import UserError


@dataclass(frozen=True)
class FamilyArgs:
    """Config values of a family's own, beyond the shared ModelArgs: a family that has any
    subclasses this (a frozen dataclass, its fields JSON values or tuples of them), names the
    subclass as its `args_type`, and its readers put an instance in ModelArgs.family_args."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent scaling ("llama3"), plain position interpolation
    ("linear"), Phi-3's LongRoPE ("longrope": per-frequency divisors, `short_factor` while the
    sequence fits the original context and `long_factor` beyond it, cos and sin scaled by
    `attention_factor`), or YaRN ("yarn": frequencies blended between kept and divided by `factor`
    along a ramp over the dims that rotate between `beta_fast` and `beta_slow` times in the
    original context, its ends rounded outwards where `truncate`; cos and sin scaled by
    `attention_factor`; `mscale_all_dim` > 0 also scales DeepSeek's softmax, see `yarn_mscale`)."""

    kind: str  # "llama3" | "linear" | "longrope" | "yarn"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: dim // n_heads
    rotary_dim: int = 0  # the leading dims of a head that rotate; 0: all (head_dim)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # GGUF files of Llama 3.1+ carry their rope scaling as a `rope_freqs` tensor of divisors.
    rope_freq_divisors: tuple[float, ...] | None = None
    max_seq_len: int = 2048  # the context the model was trained for
    # Every layer attends to at most this many latest positions (Mistral v0.1, Phi-3 mini);
    # Gemma's local layers carry their own window.
    sliding_window: int | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    out_bias: bool = False  # Llama's `attention_bias` covers o_proj too; Qwen2's q/k/v bias does not
    family: str = "llama"
    # Mixture of experts (Mixtral, Qwen3-MoE, DeepSeek-V3; 0 experts: dense). Each token's router picks
    # `n_active_experts` of `n_experts` gated MLPs of width `expert_intermediate_size`; their
    # weights are the top-k softmax probabilities, renormalized to sum to 1 if
    # `normalize_expert_weights`. `dense_layers`: layers with the dense MLP instead (Qwen3-MoE's
    # mlp_only_layers and decoder_sparse_step).
    n_experts: int = 0
    n_active_experts: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = True
    dense_layers: tuple[int, ...] = ()
    # Values of the family's own (Gemma's query scale, soft-caps, local layers): its
    # Family.args_type, read by its blocks and hooks (genfast/llm/model/families/).
    family_args: FamilyArgs | None = None

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.n_heads % self.n_kv_heads:
            raise UserError(
                f"invalid model config: {self.n_heads} attention heads are not a multiple of "
                f"{self.n_kv_heads} key/value heads"
            )
        if self.n_experts and not 0 < self.n_active_experts <= self.n_experts:
            raise UserError(f"invalid model config: {self.n_active_experts} experts per token out of {self.n_experts}")

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and layer not in self.dense_layers

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (genfast's own checkpoints store the config this way)."""
        return asdict(self)


def longrope_attention_factor(factor: float, original_context: int) -> float:
    """LongRoPE's scale of cos and sin when the context grew by `factor` (Phi-3's default)."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_context))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context grown by `factor`: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float = 0.0, mscale_all_dim: float = 0.0) -> float:
    """YaRN's default scale of cos and sin when the context grew by `factor`: `yarn_mscale`; with
    DeepSeek's `mscale` and `mscale_all_dim`, the ratio of the two corrections (as transformers)."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_inverse_frequencies(inv: list[float], rs: RopeScaling, rotary_dim: int, theta: float) -> list[float]:
    """YaRN: the dims that rotate fewer than `beta_slow` times over the original context are
    divided by `factor` (interpolated), those that rotate more than `beta_fast` times are kept
    (extrapolated), with a linear ramp between the two dims where those counts fall."""

    def dim_rotating(times: float) -> float:  # the dim whose wavelength fits `times` in the context
        context = rs.original_max_position_embeddings
        return rotary_dim * math.log(context / (times * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_rotating(rs.beta_fast), dim_rotating(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp: a step
    out = []
    for i, f in enumerate(inv):
        kept = 1 - min(max((i - low) / (high - low), 0.0), 1.0)  # 1 below the ramp, 0 above it
        out.append(f / rs.factor * (1 - kept) + f * kept)
    return out


def rope_inverse_frequencies(args: ModelArgs, long: bool = False) -> list[float]:
    """Per-pair inverse frequencies of the rotary dims, with the configured scaling applied
    (LongRoPE: its short factors, or its long ones with `long`)."""
    half = args.rotary_dim // 2
    inv = [1.0 / (args.rope_theta ** (2 * i / args.rotary_dim)) for i in range(half)]
    if args.rope_freq_divisors is not None:
        return [f / d for f, d in zip(inv, args.rope_freq_divisors, strict=True)]
    rs = args.rope_scaling
    if rs is None:
        return inv
    if rs.kind == "linear":
        return [f / rs.factor for f in inv]
    if rs.kind == "longrope":
        return [f / d for f, d in zip(inv, rs.long_factor if long else rs.short_factor, strict=True)]
    if rs.kind == "yarn":
        return yarn_inverse_frequencies(inv, rs, args.rotary_dim, args.rope_theta)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / rs.factor)
        else:
            smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor
            )
            out.append((1 - smooth) * f / rs.factor + smooth * f)
    return out
