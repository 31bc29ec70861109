"""Model configuration of the decoder families (genfast/llm/model/families/), read from the checkpoint
(never from its name)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from genfast.errors import UserError
from genfast.llm.model import families
from genfast.llm.model.families.base import FamilyArgs


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent scaling ("llama3"), plain position interpolation
    ("linear"), or Phi-3's LongRoPE ("longrope": per-frequency divisors, `short_factor` while the
    sequence fits the original context and `long_factor` beyond it, cos and sin scaled by
    `attention_factor`)."""

    kind: str  # "llama3" | "linear" | "longrope"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


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
    # Mixture of experts (Mixtral, Qwen3-MoE; 0 experts: dense). Each token's router picks
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

    @classmethod
    def from_dict(cls, fields_: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in fields(cls)} | {LEGACY_EXTRA}
        unknown = sorted(set(fields_) - known)
        if unknown:
            raise UserError(f"model config has unknown fields {unknown} (written by a newer genfast?)")
        values = dict(fields_)
        if values.get("rope_scaling") is not None:
            scaling = dict(values["rope_scaling"])
            for name in ("short_factor", "long_factor"):
                scaling[name] = tuple(scaling.get(name, ()))
            values["rope_scaling"] = RopeScaling(**scaling)
        if values.get("rope_freq_divisors") is not None:
            values["rope_freq_divisors"] = tuple(values["rope_freq_divisors"])
        values["dense_layers"] = tuple(values.get("dense_layers", ()))
        legacy = values.pop(LEGACY_EXTRA, None)
        try:
            family = values.get("family", cls.family)
            values["family_args"] = _family_args_from_dict(family, values.get("family_args"), legacy)
            return cls(**values)
        except TypeError as e:
            raise UserError(f"model config is incomplete: {e}") from e

    @property
    def n_params(self) -> int:
        """Parameter count (embedding and output head counted once when tied; every expert)."""
        qkv = self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        out = self.n_heads * self.head_dim * self.dim
        per_layer = qkv + out + 2 * self.dim
        if self.qkv_bias:
            per_layer += (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        if self.out_bias:
            per_layer += self.dim
        mlps = 0
        for layer in range(self.n_layers):
            if self.is_moe_layer(layer):  # the router and every expert's gated MLP
                mlps += self.n_experts * (self.dim + 3 * self.dim * self.expert_intermediate_size)
            else:
                mlps += 3 * self.dim * self.intermediate_size
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * per_layer + mlps + self.dim + head

    @property
    def n_active_params(self) -> int:
        """Parameters a token uses: all but the experts it is not routed to."""
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.n_layers))
        idle = moe_layers * (self.n_experts - self.n_active_experts) * 3 * self.dim * self.expert_intermediate_size
        return self.n_params - idle

    def describe_size(self) -> str:
        """E.g. '135M parameters', or for a mixture '30.5B parameters, 3.3B active (8 of 128 experts)'."""

        def count(n: int) -> str:
            return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"

        if not self.n_experts:
            return f"{count(self.n_params)} parameters"
        return (
            f"{count(self.n_params)} parameters, {count(self.n_active_params)} active "
            f"({self.n_active_experts} of {self.n_experts} experts)"
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """From a Hugging Face config.json (transformers 4.x and 5.x spellings)."""
        model_type = cfg.get("model_type")
        if model_type not in families.hf_model_types():
            raise UserError(
                f"unsupported architecture {model_type!r} (architectures {cfg.get('architectures')}); "
                f"genfast loads model_type {', '.join(families.hf_model_types())}"
            )
        rope = cfg.get("rope_parameters") or {}
        if "full_attention" in rope:  # per layer type (transformers 5, Gemma 3): the global layers'
            rope = rope["full_attention"]
        rope_scaling = cfg.get("rope_scaling") or rope
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        max_seq_len = cfg.get("max_position_embeddings", 2048)
        family = families.family(model_type)
        sliding = cfg.get("sliding_window")
        window = None
        if sliding and cfg.get("use_sliding_window", family.sliding_window_by_default) and sliding < max_seq_len:
            if family.sliding_window_by_default:  # every layer: a ring of the window each (WindowKVCache)
                window = int(sliding)
            else:  # Qwen2/3 window only some layers (max_window_layers); full attention equals
                max_seq_len = sliding  # sliding-window attention up to the window

        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            intermediate_size=cfg["intermediate_size"],
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=_rope_scaling_from_hf(rope_scaling, cfg),
            max_seq_len=max_seq_len,
            sliding_window=window,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            family=model_type,
            **family.hf_fields(cfg),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str]) -> ModelArgs:
        """From GGUF key/values; tied embeddings and biases are read off which tensors exist."""
        arch = meta.get("general.architecture")
        if arch not in families.gguf_architectures():
            raise UserError(
                f"unsupported GGUF architecture {arch!r}; genfast loads {', '.join(families.gguf_architectures())}"
            )

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise UserError(f"corrupt GGUF: metadata key {arch}.{name} is missing")
            return value

        n_heads = int(key("attention.head_count"))
        dim = int(key("embedding_length"))
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        if not vocab:
            raise UserError("corrupt GGUF: neither a vocab size nor a token list is present")
        scaling = None
        if meta.get(f"{arch}.rope.scaling.type") == "linear":
            scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
        return cls(
            vocab_size=int(vocab),
            dim=dim,
            n_layers=int(key("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(key("attention.head_count_kv", n_heads)),
            intermediate_size=int(key("feed_forward_length")),
            head_dim=int(meta.get(f"{arch}.attention.key_length", 0) or key("rope.dimension_count", dim // n_heads)),
            rotary_dim=int(meta.get(f"{arch}.rope.dimension_count", 0)),
            norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_seq_len=int(key("context_length", 2048)),
            tie_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            out_bias="blk.0.attn_output.bias" in tensor_names,
            family=arch,
            **_gguf_expert_fields(meta, arch, tensor_names),
            **families.family(arch).gguf_fields(meta, arch),
        )


# Configs saved before family_args kept the family's values in an untyped dict under this name
# (with Gemma's embedding scale, now derived from dim); `from_dict` reads them into family_args.
LEGACY_EXTRA = "extra"


def _family_args_from_dict(
    family: str, saved: dict[str, Any] | None, legacy: dict[str, Any] | None
) -> FamilyArgs | None:
    """A saved config's family_args (JSON: lists for tuples) as its family's args_type."""
    kind = families.family(family).args_type
    if kind is None:
        if saved:
            raise UserError(f"model config has family_args {saved}, but family {family!r} takes none")
        return None
    if saved is None and legacy:
        own = {f.name for f in fields(kind)}
        saved = {k: v for k, v in legacy.items() if k in own}
    if saved is None:
        raise UserError(f"model config of family {family!r} lacks its family_args")
    return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def _gguf_expert_fields(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """llama.cpp's mixture-of-experts keys: Mixtral is architecture "llama" with an expert count;
    the experts' width is the feed-forward length unless given apart (Qwen3-MoE). llama.cpp
    renormalizes the top-k weights unless the file says otherwise. A layer without a router
    tensor is dense."""
    n_experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if not n_experts:
        return {}
    width = meta.get(f"{arch}.expert_feed_forward_length") or meta.get(f"{arch}.feed_forward_length")
    active = meta.get(f"{arch}.expert_used_count")
    if not width or not active:
        raise UserError(f"corrupt GGUF: {n_experts} experts but no {arch}.expert_used_count or feed-forward length")
    return {
        "n_experts": n_experts,
        "n_active_experts": int(active),
        "expert_intermediate_size": int(width),
        "normalize_expert_weights": bool(meta.get(f"{arch}.expert_weights_norm", True)),
        "dense_layers": tuple(
            i for i in range(int(meta[f"{arch}.block_count"])) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
        ),
    }


def _rope_scaling_from_hf(rs: dict[str, Any] | None, cfg: dict[str, Any]) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind in ("longrope", "su"):
        original = int(rs.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
        # As transformers: the factor is the context's growth over the original one, unless given.
        factor = float(rs.get("factor") or cfg.get("max_position_embeddings", original) / original)
        return RopeScaling(
            "longrope",
            factor,
            original_max_position_embeddings=original,
            short_factor=tuple(float(f) for f in rs["short_factor"]),
            long_factor=tuple(float(f) for f in rs["long_factor"]),
            attention_factor=float(rs.get("attention_factor") or longrope_attention_factor(factor, original)),
        )
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs.get("low_freq_factor", 1.0)),
            float(rs.get("high_freq_factor", 4.0)),
            int(rs.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    raise UserError(f"unsupported rope scaling {kind!r}; genfast supports 'llama3', 'linear' and 'longrope'")


def longrope_attention_factor(factor: float, original_context: int) -> float:
    """LongRoPE's scale of cos and sin when the context grew by `factor` (Phi-3's default)."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_context))


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
