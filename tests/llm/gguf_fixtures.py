"""Writing small GGUF files from a transformers model, the way llama.cpp's converter lays them out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel and subclasses).
ROPE_PERMUTED = {"llama", "smollm3", "granite", "mistral3"}


def permute_for_gguf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter permutation of q/k rows (rotate-half -> interleaved pairs)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf_from_hf(
    hf_model,
    path: Path,
    arch: str = "llama",
    qtype: str = "F32",
    vocab: list[str] | None = None,
    truncate_to: int | None = None,
    split_kv_b: bool = True,
) -> Path:
    """A GGUF of `hf_model`'s weights; 2-D weights other than the embedding stored as `qtype`.
    DeepSeek (arch "deepseek2") in the layout of llama.cpp's recent converters: MQA over the
    latent, kv_b_proj split into attn_k_b (transposed per head) and attn_v_b; with `split_kv_b`
    false, in the older one (per-head key/value lengths, one attn_kv_b tensor)."""
    import gguf

    cfg = hf_model.config
    sd = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    deepseek = arch == "deepseek2"
    w.add_head_count_kv(1 if deepseek and split_kv_b else cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers'
    theta = float(rope["rope_theta"]) if "rope_theta" in rope else float(cfg.rope_theta)
    if rope.get("rope_type") == "dynamic" and rope.get("alpha"):  # HunYuan: the converter scales the base
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta *= rope["alpha"] ** (head_dim / (head_dim - 2))
    w.add_rope_freq_base(theta)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope.get("mscale_all_dim", 0.0))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0)
    w.add_rope_dimension_count(int(head_dim * partial))
    if deepseek:
        if split_kv_b:
            w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            w.add_value_length(cfg.kv_lora_rank)
            w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
            w.add_value_length_mla(cfg.v_head_dim)
        else:
            w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
            w.add_value_length(cfg.v_head_dim)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        if cfg.q_lora_rank:
            w.add_q_lora_rank(cfg.q_lora_rank)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    tokens = vocab or [f"<t{i}>" for i in range(cfg.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_norm": "attn_q_norm",  # Qwen3
        "self_attn.k_norm": "attn_k_norm",
        "self_attn.query_layernorm": "attn_q_norm",  # HunYuan
        "self_attn.key_layernorm": "attn_k_norm",
        "self_attn.qkv_proj": "attn_qkv",  # Phi-3: fused as llama.cpp keeps them
        "mlp.gate_up_proj": "ffn_up",
        # DeepSeek's latent attention and shared experts
        "self_attn.q_a_proj": "attn_q_a",
        "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    }
    gemma = arch.startswith("gemma")
    if gemma:  # llama.cpp's Gemma names and conventions
        per_layer.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                          "post_feedforward_layernorm": "post_ffw_norm"})  # fmt: skip
        assert cfg.query_pre_attn_scalar == head_dim, "GGUF has no query_pre_attn_scalar: llama.cpp uses key_length"
        if cfg.sliding_window:
            w.add_sliding_window(cfg.sliding_window)
        if getattr(cfg, "attn_logit_softcapping", None):
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if getattr(cfg, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch in ("olmo2", "exaone4"):  # post-norms only, under llama.cpp's post-norm names
        per_layer.update({"post_attention_layernorm": "post_attention_norm",
                          "post_feedforward_layernorm": "post_ffw_norm"})  # fmt: skip
        if arch == "olmo2" and getattr(cfg, "layer_types", None):  # OLMo 3's local layers
            w.add_sliding_window(cfg.sliding_window)
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "glm4":  # llama.cpp's names of GLM-4's four norms
        per_layer.update({"post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm"})
    if arch == "granite":  # llama.cpp's names of Granite's multipliers
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    n_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if n_experts:  # mixture of experts (Mixtral: architecture "llama" with an expert count)
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if hasattr(cfg, "norm_topk_prob"):
            w.add_expert_weights_norm(cfg.norm_topk_prob)
        per_layer["mlp.gate"] = "ffn_gate_inp"
    if hasattr(cfg, "n_shared_experts"):  # DeepSeek's mixture (DeepSeek-V3, GLM-4.5)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if arch == "glm4moe":  # llama.cpp's name for the norm before the MLP
        per_layer["post_attention_layernorm"] = "post_attention_norm"
    if rope.get("rope_type") == "longrope":  # Phi-3: llama.cpp stores the factors as tensors
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    for name, tensor in sd.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' stacks [E, 2 * width, dim]
            gate, up = tensor.chunk(2, dim=1)
            prefix = f"blk.{name.split('.')[2]}."
            _add(w, prefix + "ffn_gate_exps.weight", gate, qtype)
            _add(w, prefix + "ffn_up_exps.weight", up, qtype)
            continue
        if name.endswith("mlp.experts.down_proj"):
            _add(w, f"blk.{name.split('.')[2]}.ffn_down_exps.weight", tensor, qtype)
            continue
        if deepseek and name.endswith("kv_b_proj.weight") and not split_kv_b:
            _add(w, f"blk.{name.split('.')[2]}.attn_kv_b.weight", tensor, qtype)
            continue
        if deepseek and name.endswith("kv_b_proj.weight"):  # split per head, the key half transposed
            kv_b = tensor.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            k_b, v_b = kv_b.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
            prefix = f"blk.{name.split('.')[2]}."
            _add(w, prefix + "attn_k_b.weight", k_b.transpose(1, 2).contiguous(), qtype)
            _add(w, prefix + "attn_v_b.weight", v_b.contiguous(), qtype)
            continue
        if name.endswith("mlp.gate.e_score_correction_bias"):
            _add(w, f"blk.{name.split('.')[2]}.exp_probs_b.bias", tensor, "F32")
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            target = f"blk.{i}.{per_layer[module]}.{kind}"
            if arch in ROPE_PERMUTED and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
                tensor = permute_for_gguf(tensor, heads)
        else:
            target = names[name]
        if gemma and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp stores Gemma's norms as 1 + w
        _add(w, target, tensor, qtype if target != "token_embd.weight" and "ffn_gate_inp" not in target else "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate_to is not None:
        with open(path, "r+b") as f:
            f.truncate(truncate_to)
    return path


def _add(writer, name: str, tensor: torch.Tensor, qtype: str) -> None:
    """A tensor stored as `qtype` where it is a matrix (or a stack of them) of whole blocks, else F32."""
    import gguf

    data = tensor.numpy().astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if data.ndim >= 2 and qtype != "F32" and data.shape[-1] % block == 0:
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    else:
        writer.add_tensor(name, data)
