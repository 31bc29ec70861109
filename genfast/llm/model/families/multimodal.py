"""Multimodal checkpoints that people download as LLMs (Gemma 3 4B-27B, Mistral Small 3.1/3.2,
LLaVA): a language model of a genfast family beside an image encoder and a projector. genfast
loads the language model only, as data: its config is the wrapper's `text_config` (with the
wrapper's own values and transformers' defaults where it is silent), its tensors are the ones
under the wrapper's language-model prefix, and the image encoder's tensors are never read.

A wrapper whose language model is not one genfast has (Qwen2.5-VL's M-RoPE, Llama 4's mixture)
is refused, saying why.
"""

from __future__ import annotations

from typing import Any

from genfast.errors import UserError

# Wrapper model_type -> the model_type of its text_config where the config does not say
# (transformers' default for the wrapper).
WRAPPERS = {
    "gemma3": "gemma3_text",  # Gemma3ForConditionalGeneration: Gemma 3 4B, 12B, 27B
    "mistral3": "mistral",  # Mistral3ForConditionalGeneration: Mistral Small 3.1 and 3.2
    "llava": "llama",  # LlavaForConditionalGeneration (its text model any genfast family)
    "llava_next": "llama",  # LlavaNextForConditionalGeneration (LLaVA 1.6)
}

_MROPE = "its language model rotates positions in three sections (M-RoPE), which genfast does not"
# Multimodal model_types whose language model differs from every genfast family: why.
REFUSED = {
    "qwen2_vl": _MROPE,
    "qwen2_5_vl": _MROPE,
    "qwen3_vl": _MROPE,
    "qwen3_vl_moe": _MROPE,
    "llama4": "its language model (a mixture of experts with chunked attention, NoPE layers) is not a genfast family",
    "mllama": "its language model has cross-attention layers to the image",
    "gemma3n": "its language model (per-layer embeddings, AltUp) is not a genfast family",
}

# transformers' defaults for the text config fields genfast reads, by the text model's
# model_type: configs saved by transformers 4.x list only the fields that differ (Gemma 3 4B's
# text_config gives neither its vocabulary nor its heads). The spelling is transformers 5's
# (rope_parameters); a config's own rope_theta or rope_scaling still comes first.
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
        attn_logit_softcapping=None, attention_bias=False, tie_word_embeddings=True,
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    "mistral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=4096,
        tie_word_embeddings=False, rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
    ),
    "llama": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        max_position_embeddings=2048, rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
        rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
    ),
}  # fmt: skip

# Where the language model's tensors lie in a wrapper's checkpoint, as (decoder, output head)
# name prefixes: transformers 5's layout, then the older one of the checkpoints on the hub
# (which transformers 5 also writes back when it saves a model it loaded so).
TEXT_PREFIXES = (("model.language_model.", ""), ("language_model.model.", "language_model."))
PLAIN_PREFIXES = ("model.", "")  # a text model's own checkpoint


def is_wrapper(cfg: dict[str, Any]) -> bool:
    """Whether a config.json is a multimodal wrapper (one genfast loads or not)."""
    return cfg.get("model_type") in WRAPPERS or cfg.get("model_type") in REFUSED or "text_config" in cfg


def architecture(cfg: dict[str, Any]) -> str:
    """The wrapper's class name, for messages."""
    return (cfg.get("architectures") or [cfg.get("model_type")])[0]


def text_config(cfg: dict[str, Any], known_types: list[str], tensor_names: set[str] | None = None) -> dict[str, Any]:
    """A wrapper's language model's config, complete and flat, as a text model's config.json
    would be: the text_config, then the wrapper's values of the fields it shares, then
    transformers' defaults. Embeddings are tied where the checkpoint holds no output head
    (`tensor_names`; transformers 5 unties a head that is stored, whatever the config says), else
    as the config says. `known_types`: the text model_types genfast loads."""
    model_type = cfg.get("model_type")
    if model_type in REFUSED:
        raise UserError(f"{architecture(cfg)} is not supported: {REFUSED[model_type]}")
    if model_type not in WRAPPERS:
        raise UserError(
            f"unsupported multimodal architecture {model_type!r} ({architecture(cfg)}); genfast loads the text "
            f"part of model_type {', '.join(sorted(WRAPPERS))}"
        )
    text = dict(cfg.get("text_config") or {})
    text_type = text.get("model_type") or WRAPPERS[model_type]
    if text_type not in known_types:
        raise UserError(
            f"the language model of this {architecture(cfg)} is model_type {text_type!r}, which genfast does not load"
        )
    shared = {k: cfg[k] for k in ("vocab_size", "tie_word_embeddings") if k in cfg}
    flat = {**TEXT_DEFAULTS.get(text_type, {}), **shared, **text, "model_type": text_type}
    if tensor_names is not None:
        flat["tie_word_embeddings"] = not any(head + "lm_head.weight" in tensor_names for _, head in TEXT_PREFIXES)
    return flat


def text_prefixes(tensor_names: set[str], wrapped: bool) -> tuple[str, str]:
    """The (decoder, output head) prefixes of the language model's tensors in a checkpoint."""
    if not wrapped:
        return PLAIN_PREFIXES
    for decoder, head in TEXT_PREFIXES:
        if decoder + "embed_tokens.weight" in tensor_names:
            return decoder, head
    wanted = " or ".join(decoder + "embed_tokens.weight" for decoder, _ in TEXT_PREFIXES)
    raise UserError(f"the checkpoint holds no language model: it has no tensor {wanted}")
