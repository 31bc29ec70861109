"""Tiny random Hugging Face checkpoints written to disk, shared by the LLM tests."""

from __future__ import annotations

from pathlib import Path

import torch

# What the later families' tiny configs share: two layers of width 64, GQA, tied embeddings.
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

TINY_CONFIGS = {
    # GQA, untied head, Llama-3.1 rope scaling.
    "llama3": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    # Tied embeddings, SmolLM2-like.
    "smollm": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=300,
        hidden_size=48,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    # q/k/v bias, tied.
    "qwen2": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
    ),
    # Per-head q/k RMSNorm, head_dim set apart from hidden_size / heads, untied.
    "qwen3": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        use_sliding_window=False,
    ),
    # Fused qkv_proj and gate_up_proj, partial rotary embedding (Phi-4-mini's 0.75), tied.
    "phi3": dict(
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        partial_rotary_factor=0.75,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # LongRoPE (Phi-3-mini-128k's scheme) with a 16-token original context, so that a test
    # sequence crosses into the long factors.
    "phi3_longrope": dict(
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        original_max_position_embeddings=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=dict(
            type="longrope",
            short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            long_factor=[1.0, 1.5, 2.4, 3.9, 6.0, 9.1, 13.5, 19.0],
        ),
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # (1 + w) norms around attention and MLP, GeGLU, soft-capping, a 6-token window on even layers,
    # tied; query_pre_attn_scalar = head_dim as in Gemma 2 2B and 9B (GGUF stores no other).
    "gemma2": dict(
        model_type="gemma2",
        architectures=["Gemma2ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        sliding_window=6,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Gemma 2's block plus q/k norms, five local layers (5-token window, their own rope base) to
    # one global (linear rope scaling), no soft-capping.
    "gemma3": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling=dict(rope_type="linear", factor=2.0),
        sliding_window=5,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Mistral v0.1's sliding window on every layer (8 tokens here), beyond which the context goes on.
    "mistral_window": dict(
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # Mixture of experts: top-2 of 4 experts in every layer, weights renormalized.
    "mixtral": dict(
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    # Qwen3's attention with top-3 of 8 experts, weights not renormalized (norm_topk_prob false;
    # Mixtral covers the renormalized case), and a dense layer between MoE ones (mlp_only_layers).
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        use_sliding_window=False,
    ),
    # NoPE: every fourth layer (the default interval, which llama.cpp assumes for GGUF) attends
    # without rotary positions; tied, as SmolLM3-3B.
    "smollm3": dict(
        SMALL, model_type="smollm3", architectures=["SmolLM3ForCausalLM"], num_hidden_layers=4, rope_theta=50000.0
    ),
    # q/k/v biases without an output bias, head_dim apart from hidden_size / heads, untied.
    "seed_oss": dict(
        SMALL,
        model_type="seed_oss",
        architectures=["SeedOssForCausalLM"],
        head_dim=24,
        attention_bias=True,
        attention_out_bias=False,
        tie_word_embeddings=False,
    ),
    # Post-norms (no pre-norms), q/k norms over the whole projection, untied.
    "olmo2": dict(
        SMALL, model_type="olmo2", architectures=["Olmo2ForCausalLM"], rope_theta=500000.0, tie_word_embeddings=False
    ),
    # OLMo 2's block with a 6-token window on the first layer (layer_types), rotary as the global one.
    "olmo3": dict(
        SMALL,
        model_type="olmo3",
        architectures=["Olmo3ForCausalLM"],
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    # Post-norms and per-head q/k norms, every layer global and rotary (EXAONE 4.0 1.2B's layout,
    # the one llama.cpp assumes for GGUF files of any size but the 32B's).
    "exaone4": dict(
        SMALL,
        model_type="exaone4",
        architectures=["Exaone4ForCausalLM"],
        sliding_window=None,
        layer_types=["full_attention", "full_attention"],
        rope_theta=1000000.0,
    ),
    # Four norms per block, q/k/v biases, fused gate_up_proj, rotary on interleaved pairs of half
    # of each head's dims, untied.
    "glm4": dict(
        SMALL,
        model_type="glm4",
        architectures=["Glm4ForCausalLM"],
        head_dim=16,
        partial_rotary_factor=0.5,
        attention_bias=True,
        tie_word_embeddings=False,
    ),
    # Per-head q/k norms after the rotary embedding, NTK-alpha ("dynamic") rope.
    "hunyuan_dense": dict(
        SMALL,
        model_type="hunyuan_v1_dense",
        architectures=["HunYuanDenseV1ForCausalLM"],
        head_dim=16,
        rope_scaling=dict(type="dynamic", alpha=1000.0, factor=1.0),
    ),
    # Embedding, attention and residual multipliers and logits scaling, values of Granite 3's size.
    "granite": dict(
        SMALL,
        model_type="granite",
        architectures=["GraniteForCausalLM"],
        embedding_multiplier=12.0,
        attention_multiplier=0.0078125,
        residual_multiplier=0.22,
        logits_scaling=8.0,
    ),
    # Rotary pairs interleaved (not halves), head_dim set apart.
    "ernie4_5": dict(
        SMALL, model_type="ernie4_5", architectures=["Ernie4_5ForCausalLM"], head_dim=16, rope_theta=500000.0
    ),
    # DeepSeek-V3's shape in small: latent attention with a q latent, YaRN (mscale_all_dim: the
    # softmax scale too), a dense first layer, then 2 of 8 routed experts in 4 groups (2 groups
    # kept) plus a shared expert, renormalized and scaled weights.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_mtp_layers=0,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            mscale=1.0,
            mscale_all_dim=1.0,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
    # DeepSeek-V2-Lite's attention: no q latent (one q projection), plain rope, unscaled weights,
    # no groups; rotary rows in rotate-half order (rope_interleave false).
    "deepseek_lite": dict(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=24,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_interleave=False,
        tie_word_embeddings=False,
        num_mtp_layers=0,
        rope_theta=10000.0,
    ),
    # GLM-4.5: DeepSeek's mixture (2 of 8 experts in 2 groups, one kept; a shared expert; a dense
    # first layer) under GQA with q/k/v biases, half-rotary heads and per-head q/k norms.
    "glm4_moe": dict(
        model_type="glm4_moe",
        architectures=["Glm4MoeForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=True,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        norm_topk_prob=True,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        num_mtp_layers=0,
    ),
    # Linear rope scaling, MHA (no GQA), attention_bias.
    "llama2_linear": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=True,
        rope_scaling=dict(rope_type="linear", factor=2.0),
    ),
}


def hf_model_from_config(config: dict, seed: int = 0):
    """A transformers model (fp32, eval mode) initialized as transformers does, for a config in
    TINY_CONFIGS' form (model_type and architectures included)."""
    import transformers

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures")
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(model_type, **cfg)
    return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()


def make_hf_model(name: str, seed: int = 0, **changes):
    """A transformers model with random weights for one of TINY_CONFIGS (`changes`: config fields
    that differ)."""
    return randomize_norms(hf_model_from_config({**TINY_CONFIGS[name], **changes}, seed))


def randomize_norms(model):
    """`model` with its norms and biases moved off HF's initial values (ones, zeros), so that they
    are tested too, its routers' and DeepSeek's choice-only biases made decisive."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("mlp.gate.weight"):  # routers: clear choices, so rounding never flips an expert
                p.normal_(0, 1.0)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # DeepSeek's choice-only bias: make it matter
                b.normal_(0, 0.3)
    return model.eval()


def save_hf_model(model, directory: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def word_tokenizer(vocab_size: int):
    """A genfast Tokenizer over words 'w0'..'wN' (ids = numbers), for tiny random models."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from genfast.llm.checkpoints.tokenizer import Tokenizer

    backend = Backend(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    return Tokenizer(backend, bos_id=None, add_bos=False, stop_ids=set())


def tiny_genfast_model(name: str, tmp_path: Path, seed: int = 0):
    """(transformers model, genfast model) with identical random weights."""
    from genfast.llm.checkpoints.checkpoint import Checkpoint
    from genfast.llm.checkpoints.weights import load_model

    hf = make_hf_model(name, seed)
    return hf, load_model(Checkpoint.open(save_hf_model(hf, tmp_path / f"{name}-{seed}")))


TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"


def save_tiny_chat_model(directory: Path, context: int = 256) -> Path:
    """The tiny llama3 model with a `context`-token window and a word tokenizer whose chat template
    joins the turns as plain words ("user w5 w6 "), saved as a Hugging Face directory."""
    hf = hf_model_from_config(dict(TINY_CONFIGS["llama3"], max_position_embeddings=context))
    save_hf_model(hf, directory)
    tokenizer = word_tokenizer(TINY_CONFIGS["llama3"]["vocab_size"])
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save(directory)
    return directory
