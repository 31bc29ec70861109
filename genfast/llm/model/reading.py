"""ModelArgs from what a checkpoint says (never from its name): a Hugging Face config.json, GGUF
metadata, or the dict genfast's own checkpoints saved. Each family adds its own fields
(genfast/llm/model/families/)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from genfast.errors import UserError
from genfast.llm.model import families
from genfast.llm.model.config import (
    FamilyArgs,
    ModelArgs,
    RopeScaling,
    longrope_attention_factor,
    yarn_attention_factor,
)
from genfast.llm.model.families import multimodal

# The quantization_config methods whose tensors genfast reads: gpt-oss's MXFP4 experts
# (genfast/llm/checkpoints/weights.py). FP8 (DeepSeek-V3's release, for one), GPTQ, AWQ and
# bitsandbytes checkpoints are refused.
READABLE_QUANT_METHODS = ("mxfp4",)


def args_from_hf_config(cfg: dict[str, Any], tensor_names: set[str] | None = None) -> ModelArgs:
    """From a Hugging Face config.json (transformers 4.x and 5.x spellings). A multimodal wrapper's
    (Gemma 3 4B+, Mistral Small 3.1): its language model's (genfast/llm/model/families/multimodal.py),
    whose tied embeddings are read off `tensor_names`, the checkpoint's, where given."""
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method is not None and method not in READABLE_QUANT_METHODS:  # its tensors would load as if unscaled
        raise UserError(
            f"this checkpoint's weights are quantized with {method!r} (its quantization_config), which genfast "
            "does not read; use the model's bf16 release or a GGUF file (genfast quantizes with --quant)"
        )
    if multimodal.is_wrapper(cfg):
        cfg = multimodal.text_config(cfg, families.hf_model_types(), tensor_names)
    model_type = cfg.get("model_type")
    if model_type not in families.hf_model_types():
        raise UserError(
            f"unsupported architecture {model_type!r} (architectures {cfg.get('architectures')}); "
            f"genfast loads model_type {', '.join(families.hf_model_types())}"
        )
    if cfg.get("mlp_bias"):  # Llama, Granite, Seed-OSS may say so; the tensors would go unread
        raise UserError(f"{model_type} checkpoints with mlp_bias (biases in the MLP's projections) are not supported")
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

    own = family.hf_fields(cfg)  # the family's fields take precedence over the shared reading
    shared = dict(
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
        max_seq_len=max_seq_len,
        sliding_window=window,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        family=model_type,
    )
    if "rope_scaling" not in own:  # a family may read a scheme of its own (HunYuan's NTK alpha)
        shared["rope_scaling"] = _rope_scaling_from_hf(rope_scaling, cfg)
    return ModelArgs(**{**shared, **own})


def args_from_gguf_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelArgs:
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
    elif meta.get(f"{arch}.rope.scaling.type") == "yarn":  # llama.cpp's defaults for what GGUF does not store
        factor = float(key("rope.scaling.factor"))
        scaling = RopeScaling(
            "yarn",
            factor,
            original_max_position_embeddings=int(key("rope.scaling.original_context_length")),
            attention_factor=yarn_attention_factor(factor),
        )
    values: dict[str, Any] = dict(
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
    )
    values.update(families.family(arch).gguf_fields(meta, arch, tensor_names))  # the family's own reading wins
    return ModelArgs(**values)


def args_from_dict(fields_: dict[str, Any]) -> ModelArgs:
    """ModelArgs from the dict `ModelArgs.to_dict` saved (genfast's own checkpoints)."""
    known = {f.name for f in fields(ModelArgs)} | {LEGACY_EXTRA}
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
        family = values.get("family", ModelArgs.family)
        values["family_args"] = _family_args_from_dict(family, values.get("family_args"), legacy)
        return ModelArgs(**values)
    except TypeError as e:
        raise UserError(f"model config is incomplete: {e}") from e


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
    if kind == "yarn":
        original = int(rs.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048))
        # As transformers: the factor is the context's growth over the original one, unless given.
        factor = float(rs.get("factor") or cfg.get("max_position_embeddings", original) / original)
        mscale_all_dim = float(rs.get("mscale_all_dim") or 0)
        default = yarn_attention_factor(factor, float(rs.get("mscale") or 0), mscale_all_dim)
        return RopeScaling(
            "yarn",
            factor,
            original_max_position_embeddings=original,
            attention_factor=float(rs.get("attention_factor") or default),
            beta_fast=float(rs.get("beta_fast") or 32.0),
            beta_slow=float(rs.get("beta_slow") or 1.0),
            truncate=bool(rs.get("truncate", True)),
            mscale_all_dim=mscale_all_dim,
        )
    raise UserError(f"unsupported rope scaling {kind!r}; genfast supports 'llama3', 'linear', 'longrope' and 'yarn'")
