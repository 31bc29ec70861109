"""ModelArgs as configs give it and as genfast saves it: a family's own values are typed
(ModelArgs.family_args, the family's args_type), survive the JSON that quantized checkpoints and
compiled steps' keys store, and configs saved with the older untyped `extra` dict still load."""

from __future__ import annotations

import json

import pytest
import torch

from genfast.errors import UserError
from genfast.llm.model import families
from genfast.llm.model.config import ModelArgs
from genfast.llm.model.families.gemma2 import GemmaArgs
from genfast.llm.model.families.gemma3 import Gemma3Args
from genfast.llm.model.reading import LEGACY_EXTRA, args_from_dict, args_from_hf_config
from genfast.llm.model.transformer import describe_size, parameter_counts
from tests.llm.hf_fixtures import TINY_CONFIGS


def _saved(args: ModelArgs) -> dict:
    return json.loads(json.dumps(args.to_dict()))


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_saved_config_reads_back_equal(name):
    args = args_from_hf_config(TINY_CONFIGS[name])
    again = args_from_dict(_saved(args))
    assert again == args and hash(again) == hash(args)
    kind = families.family(args.family).args_type
    assert again.family_args is None if kind is None else type(again.family_args) is kind


def test_gemma_values_are_typed():
    gemma2 = args_from_hf_config(TINY_CONFIGS["gemma2"])
    assert gemma2.family_args == GemmaArgs(
        query_pre_attn_scalar=16, sliding_window=6, sliding_layers=(0, 2), attn_logit_softcap=5.0,
        final_logit_softcap=3.0,
    )  # fmt: skip
    gemma3 = args_from_hf_config(TINY_CONFIGS["gemma3"])
    assert isinstance(gemma3.family_args, Gemma3Args)
    assert gemma3.family_args.sliding_layers == (0, 1, 2, 3, 4) and gemma3.family_args.local_rope_theta == 10000.0
    assert args_from_hf_config(TINY_CONFIGS["llama3"]).family_args is None


def test_family_values_are_part_of_equality():
    """Two Gemmas that differ only in a soft-cap are different models (compiled steps key on args)."""
    cfg = TINY_CONFIGS["gemma2"]
    assert args_from_hf_config(cfg) != args_from_hf_config({**cfg, "final_logit_softcapping": 30.0})


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_config_saved_with_the_untyped_extra_dict_still_loads(name):
    args = args_from_hf_config(TINY_CONFIGS[name])
    legacy = _saved(args)
    own = legacy.pop("family_args")
    if name == "gemma3":
        del own["local_rope_theta"]  # GGUF-read configs left it out: the default applied
    legacy[LEGACY_EXTRA] = {**own, "embedding_scale": args.dim**0.5}
    assert args_from_dict(legacy) == args
    plain = _saved(args_from_hf_config(TINY_CONFIGS["llama3"]))
    del plain["family_args"]
    assert args_from_dict({**plain, LEGACY_EXTRA: {}}) == args_from_dict(plain)


def test_family_args_that_do_not_fit_the_family_are_refused():
    llama = _saved(args_from_hf_config(TINY_CONFIGS["llama3"]))
    with pytest.raises(UserError, match="takes none"):
        args_from_dict({**llama, "family_args": {"sliding_window": 4}})
    gemma = _saved(args_from_hf_config(TINY_CONFIGS["gemma2"]))
    with pytest.raises(UserError, match="lacks its family_args"):
        args_from_dict({**gemma, "family_args": None})
    with pytest.raises(UserError, match="incomplete"):
        args_from_dict({**gemma, "family_args": {"sliding_window": 4}})


def test_hooks_are_the_identity_unless_a_family_sets_them():
    x = torch.randn(2, 3, 64)
    llama = args_from_hf_config(TINY_CONFIGS["llama3"])
    family = families.family(llama.family)
    assert family.scale_embeddings(llama, x) is x and family.final_logits(llama, x) is x
    gemma2 = args_from_hf_config(TINY_CONFIGS["gemma2"])
    family = families.family(gemma2.family)
    torch.testing.assert_close(family.scale_embeddings(gemma2, x), x * 8.0)
    torch.testing.assert_close(family.final_logits(gemma2, x), torch.tanh(x / 3.0) * 3.0)
    gemma3 = args_from_hf_config(TINY_CONFIGS["gemma3"])  # no final soft-cap
    assert families.family(gemma3.family).final_logits(gemma3, x) is x


def test_a_quantized_gemma_directory_loads_back_with_its_family_args(tmp_path):
    """`genfast quantize` stores the config as JSON in its header: the Gemma read back from it is
    the model quantized on load, logit for logit."""
    from genfast.cli import main
    from genfast.llm.loading import load
    from tests.llm.hf_fixtures import make_hf_model, save_hf_model, word_tokenizer

    directory = save_hf_model(make_hf_model("gemma2"), tmp_path / "gemma2")
    word_tokenizer(256).save(directory)
    out = tmp_path / "q"
    assert main(["quantize", "-m", str(directory), "--mode", "int8", "-o", str(out), "--dtype", "float32"]) == 0
    saved, on_load = load(str(out), "cpu", "float32"), load(str(directory), "cpu", "float32", quant="int8")
    assert saved.model.args == on_load.model.args and isinstance(saved.model.args.family_args, GemmaArgs)
    tokens = torch.arange(3, 20)[None]
    with torch.no_grad():
        want = on_load.model(tokens, torch.arange(17), all_logits=True)
        torch.testing.assert_close(saved.model(tokens, torch.arange(17), all_logits=True), want, atol=0, rtol=0)


@pytest.mark.parametrize(
    "name, changes",
    [("llama3", {"mlp_bias": True}), ("granite", {"mlp_bias": True}), ("ernie4_5", {"use_bias": True})],
)
def test_biases_genfast_does_not_read_are_refused(name, changes):
    """MLP biases would be left unread (and the logits wrong): such configs are refused."""
    with pytest.raises(UserError, match="not supported"):
        args_from_hf_config({**TINY_CONFIGS[name], **changes})


def _checkpoint_numel(hf: torch.nn.Module) -> int:
    """Values of the tensors a transformers checkpoint stores: the parameters (a tied head once) and
    persistent buffers (DeepSeek's e_score_correction_bias)."""
    persistent = hf.state_dict().keys()
    return sum(p.numel() for p in hf.parameters()) + sum(
        b.numel() for name, b in hf.named_buffers() if name in persistent
    )


def _hf_on_meta(config: dict) -> torch.nn.Module:
    import transformers

    cfg = {k: v for k, v in config.items() if k != "architectures"}
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))


@pytest.mark.parametrize("name", [*sorted(TINY_CONFIGS), "gpt_oss"])
def test_parameter_count_is_what_transformers_checkpoint_holds(name):
    from tests.llm.model.test_gpt_oss import CONFIG as GPT_OSS

    config = GPT_OSS if name == "gpt_oss" else TINY_CONFIGS[name]
    assert parameter_counts(args_from_hf_config(config))[0] == _checkpoint_numel(_hf_on_meta(config))


# Published config.json values (DeepSeek-V3's without its multi-token-prediction layer, which
# neither transformers nor genfast builds).
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
    n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
    first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, rope_theta=10000.0,
    rope_scaling=dict(type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096),
)  # fmt: skip
GPT_OSS_20B = dict(
    model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
    sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    attention_bias=True, layer_types=["sliding_attention", "full_attention"] * 12,
    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=4096), rope_theta=150000.0,
)  # fmt: skip


def test_deepseek_v3_has_its_published_671b_and_37b_active():
    args = args_from_hf_config(DEEPSEEK_V3)
    assert parameter_counts(args)[0] == _checkpoint_numel(_hf_on_meta(DEEPSEEK_V3))
    assert parameter_counts(args)[0] == pytest.approx(671e9, rel=0.001)
    assert parameter_counts(args)[1] == pytest.approx(37e9, rel=0.02)
    assert describe_size(args) == f"671.0B parameters, {parameter_counts(args)[1] / 1e9:.1f}B active (8 of 256 experts)"


def test_gpt_oss_20b_has_its_published_20_91b_and_3_61b_active():
    args = args_from_hf_config(GPT_OSS_20B)
    assert parameter_counts(args)[0] == _checkpoint_numel(_hf_on_meta(GPT_OSS_20B))
    assert parameter_counts(args)[0] == pytest.approx(20.91e9, abs=0.005e9)
    # OpenAI's model card counts the output head but not the looked-up embedding as active.
    assert parameter_counts(args)[1] - args.vocab_size * args.dim == pytest.approx(3.61e9, abs=0.005e9)


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq", "bitsandbytes"])
def test_checkpoints_quantized_in_formats_genfast_does_not_read_are_refused(method):
    """Their tensors would otherwise load as if unscaled; a wrapper's top-level config says it too."""
    quantized = dict(TINY_CONFIGS["llama3"], quantization_config={"quant_method": method})
    with pytest.raises(UserError, match=f"quantized with '{method}'"):
        args_from_hf_config(quantized)
    text = {k: v for k, v in TINY_CONFIGS["mistral_window"].items() if k != "architectures"}
    wrapper = {"model_type": "mistral3", "text_config": text, "quantization_config": {"quant_method": method}}
    with pytest.raises(UserError, match=f"quantized with '{method}'"):
        args_from_hf_config(wrapper)
    assert args_from_hf_config(dict(TINY_CONFIGS["llama3"], quantization_config={"quant_method": "mxfp4"}))
