"""DeepSeek-V3's own pieces (genfast/llm/model/families/deepseek.py) beyond the shared family tests
(test_families.py runs the deepseek_v3 tiny model through logits, CLI text, compile and
quantization): the V2-Lite-shaped variant, the latent cache (its size, decode against
transformers, the absorbed and expanded forms agreeing), the router against transformers',
YaRN against transformers' rope init, speculative decoding, the serve engine with a prefix-cache
hit, and the refusal of --tp."""

from __future__ import annotations

import pytest
import torch

from genfast.errors import UserError
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.weights import load_model
from genfast.llm.decoding.drafters import LayerDrafter
from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.speculative import SpeculativeGenerator
from genfast.llm.decoding.stats import format_stats, kv_bytes_per_slot, kv_bytes_read
from genfast.llm.model.config import rope_inverse_frequencies
from genfast.llm.model.layers import LatentKVCache
from genfast.llm.model.moe import GroupLimitedRouter
from genfast.llm.model.reading import args_from_hf_config
from genfast.llm.model.transformer import attention_mask
from genfast.llm.tensor_parallel import check_shardable
from genfast.serve.engine import Engine, GenerationRequest
from tests.llm.gguf_fixtures import write_gguf_from_hf
from tests.llm.hf_fixtures import TINY_CONFIGS, make_hf_model, save_hf_model, word_tokenizer

ATOL = 1e-4


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(transformers model, genfast model, saved directory) of the tiny deepseek_v3 config."""
    hf = make_hf_model("deepseek_v3")
    directory = save_hf_model(hf, tmp_path_factory.mktemp("deepseek") / "deepseek_v3")
    word_tokenizer(hf.config.vocab_size).save(directory)
    return hf, load_model(Checkpoint.open(directory)), directory


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_lite_variant_from_safetensors_and_gguf_equals_transformers(tmp_path):
    """No q latent, rotate-half rotary rows, three experts of eight unscaled and not renormalized,
    two shared experts, no groups: logits as transformers', from safetensors and from GGUFs in
    both of llama.cpp's layouts."""
    hf = make_hf_model("deepseek_lite")
    tokens = _tokens(19, seed=3)
    with torch.no_grad():
        expected = hf(tokens).logits
        directory = save_hf_model(hf, tmp_path / "lite")
        model = load_model(Checkpoint.open(directory))
        assert not hasattr(model.layers[0].attention, "wq_a")
        torch.testing.assert_close(model(tokens, torch.arange(19), all_logits=True), expected, atol=ATOL, rtol=0)
        # GGUF: llama.cpp's converter keeps the checkpoint's rotary rows; rotate-half ones are
        # written as interleaved pairs, which the reader assumes.
        interleaved = make_hf_model("deepseek_lite", rope_interleave=True)
        interleaved.load_state_dict(_interleaved_rope_rows(hf))
        for split in (True, False):  # recent converters' attn_k_b/attn_v_b, older ones' attn_kv_b
            path = write_gguf_from_hf(interleaved, tmp_path / f"lite-{split}.gguf", arch="deepseek2", split_kv_b=split)
            gguf = load_model(Checkpoint.open(path))
            torch.testing.assert_close(gguf(tokens, torch.arange(19), all_logits=True), expected, atol=ATOL, rtol=0)


def _interleaved_rope_rows(hf) -> dict:
    """`hf`'s weights with the rotary rows of q and of the shared key in interleaved pairs: the
    same model for rope_interleave=True."""
    cfg = hf.config
    rope, head = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    to_pairs = torch.stack([torch.arange(rope // 2), torch.arange(rope // 2) + rope // 2], dim=1).reshape(-1)

    def reorder(w: torch.Tensor, per: int) -> torch.Tensor:
        order = torch.cat([torch.arange(per - rope), to_pairs + per - rope])
        return w.reshape(-1, per, *w.shape[1:])[:, order].reshape(w.shape)

    state = dict(hf.state_dict())
    for name, w in state.items():
        if name.endswith("self_attn.q_proj.weight"):
            state[name] = reorder(w, head)
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            state[name] = reorder(w, cfg.kv_lora_rank + rope)
    return state


def test_the_cache_holds_the_latent_and_shared_key_per_position(deepseek):
    """kv_lora_rank + qk_rope_head_dim values per position and layer, and the stats count that."""
    _, model, _ = deepseek
    own = model.args.family_args
    model.setup_caches(2, 64)
    caches = [layer.attention.kv_cache for layer in model.layers]
    assert all(isinstance(c, LatentKVCache) and c.latent.shape == (2, 1, 64, 32 + 8) for c in caches)
    per_token = model.args.n_layers * (own.kv_lora_rank + own.qk_rope_head_dim) * 4  # fp32
    assert kv_bytes_per_slot(model) == per_token == 3 * 40 * 4
    assert kv_bytes_read(model, 10) == 10 * per_token
    result = Generator(model, word_tokenizer(256), max_seq_len=64, compile=False).generate([[3, 4, 5]], 4)
    assert ", 0.5 KB per token)" in format_stats(model, result, 1e10, None, torch.device("cpu"))


def test_decode_through_the_latent_cache_equals_transformers(deepseek):
    """Prefill (expanded form) then single-token decode steps (absorbed form), two rows at their
    own positions (continuous batching), against transformers' full forward."""
    hf, model, _ = deepseek
    rows = [_tokens(24, seed=5), _tokens(24, seed=6)]
    with torch.no_grad():
        expected = [hf(r).logits[0] for r in rows]
        model.setup_caches(2, 64)
        for row, (tokens, length) in enumerate(zip(rows, (12, 17), strict=True)):
            pos = torch.arange(length)
            model(tokens[:, :length], pos, attention_mask(pos, length), cache_rows=torch.tensor([row]))
        lengths = torch.tensor([12, 17])
        for _ in range(6):
            pos = lengths[:, None]
            step = torch.stack([rows[r][0, lengths[r]] for r in range(2)])[:, None]
            logits = model(step, pos, attention_mask(pos, int(lengths.max()) + 1))
            for r in range(2):
                torch.testing.assert_close(logits[r], expected[r][lengths[r]], atol=ATOL, rtol=0)
            lengths = lengths + 1


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_decode_keeps_kv_b_in_float_within_budget_and_counts_its_bytes(deepseek, bits):
    """int8/int4 leave kv_b_proj in float (LatentAttention's comment says why): the absorbed decode
    steps stay within the quantization budget of the unquantized model's (the prefill's expanded
    form: test_families.py; measured relative error 0.010 int8, 0.088 int4), and the decode bytes
    count kv_b as stored."""
    from genfast.llm.checkpoints.quantize import quantize_loaded
    from genfast.llm.decoding.stats import weight_bytes_per_step
    from tests.llm.model.test_families import BUDGET

    _, reference, directory = deepseek
    checkpoint = Checkpoint.open(directory)
    model = load_model(checkpoint)
    quantize_loaded(checkpoint, model, bits, None)
    tokens = _tokens(20, seed=7)
    steps = []
    with torch.no_grad():
        for m in (reference, model):
            m.setup_caches(1, 32)
            pos = torch.arange(12)
            m(tokens[:, :12], pos, attention_mask(pos, 12))
            steps.append(
                torch.cat(
                    [
                        m(tokens[:, i : i + 1], torch.tensor([i]), attention_mask(torch.tensor([i]), i + 1))
                        for i in range(12, 20)
                    ]
                )
            )
    reference.clear_caches()  # the module's model, as the other tests expect it
    want, got = steps
    max_error, max_kl = BUDGET[f"int{bits}"]
    assert float((got - want).norm() / want.norm()) <= max_error
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    assert float(kl.sum(-1).mean()) <= max_kl
    kv_b = [layer.attention.wkv_b for layer in model.layers]
    assert all(w.dtype == torch.float32 for w in kv_b)
    with_kv_b = weight_bytes_per_step(model)
    for layer in model.layers:
        layer.attention.wkv_b = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    assert with_kv_b - weight_bytes_per_step(model) == sum(w.nbytes for w in kv_b)


def test_absorbed_and_expanded_attention_agree(deepseek):
    _, model, _ = deepseek
    attention = model.layers[1].attention
    h, s, length = attention.n_heads, 3, 11
    gen = torch.Generator().manual_seed(0)
    q_nope = torch.randn(2, h, s, attention.nope, generator=gen)
    q_rope = torch.randn(2, h, s, attention.rope, generator=gen)
    cached = torch.randn(2, 1, length, attention.rank + attention.rope, generator=gen)
    mask = attention_mask(torch.arange(length - s, length), length)
    absorbed = attention.attend_absorbed(q_nope, q_rope, cached, mask)
    expanded = attention.attend_expanded(q_nope, q_rope, cached, mask)
    assert absorbed.shape == (2, h, s, attention.v_dim)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


def test_router_equals_transformers(deepseek):
    """Group-limited choice by biased sigmoid scores, weights from the unbiased ones, renormalized
    and scaled: the same experts and weights as transformers' router on many tokens."""
    hf, model, _ = deepseek
    theirs = hf.model.layers[1].mlp.gate
    ours = model.layers[1].feed_forward.router
    assert isinstance(ours, GroupLimitedRouter) and ours.correction_bias.abs().sum() > 0
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, their_weights, their_experts = theirs(x)
        weights, experts = ours(x)
    order, their_order = experts.argsort(-1), their_experts.argsort(-1)
    assert torch.equal(experts.gather(1, order), their_experts.gather(1, their_order))
    torch.testing.assert_close(weights.gather(1, order), their_weights.gather(1, their_order))


@pytest.mark.parametrize("changes", [{}, {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707}])
def test_yarn_frequencies_and_scales_equal_transformers(changes):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = dict(TINY_CONFIGS["deepseek_v3"])
    cfg["rope_parameters"] = {**cfg["rope_parameters"], **changes}
    if changes:
        cfg["max_position_embeddings"] = int(changes["factor"] * changes["original_max_position_embeddings"])
    config = transformers.AutoConfig.for_model(
        "deepseek_v3", **{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    args = args_from_hf_config(cfg)
    torch.testing.assert_close(torch.tensor(rope_inverse_frequencies(args)), inv_freq, atol=0, rtol=1e-6)
    assert args.rope_scaling.attention_factor == pytest.approx(attention_factor)
    hf_attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, 0)
    from genfast.llm.model.families.deepseek import softmax_scale

    assert softmax_scale(args) == pytest.approx(hf_attention.scaling)


def test_speculative_decoding_and_the_serve_engine_give_the_greedy_tokens(deepseek):
    """A layer-skip drafter's speculative decoding, and the serve engine where a third request
    restores the 32-token prefix it shares with the first from the prefix cache (latent blocks;
    its one row holds the second, unrelated request), give plain greedy decoding's tokens."""
    _, model, directory = deepseek
    tok = word_tokenizer(256)
    system = [(5 * i) % 200 + 3 for i in range(32)]
    a, b, other = system + [20, 21, 22], system + [30, 31], [7] * 20
    plain = Generator(model, tok, max_seq_len=128, compile=False)
    want = [plain.generate([p], 12, stop_at_eos=False).token_ids[0] for p in (a, b, other)]
    spec = SpeculativeGenerator(model, tok, LayerDrafter(1), k=3, max_seq_len=128, compile=False)
    assert spec.generate([a], 12, stop_at_eos=False).token_ids[0] == want[0]

    engine = Engine(load_model(Checkpoint.open(directory)), tok, max_batch=1, compile=False, prefix_block=16)
    engine.start()
    try:
        got = [engine.generate(GenerationRequest(tuple(p), 12)) for p in (a, other, b)]
    finally:
        engine.shutdown()
    assert [g.token_ids for g in got] == [want[0], want[2], want[1]]
    assert got[2].cached_tokens == 32


def test_tensor_parallelism_is_refused_in_one_sentence():
    for name in ("deepseek_v3", "glm4_moe"):
        with pytest.raises(UserError, match=f"--tp 2: {name} models do not run tensor-parallel yet"):
            check_shardable(args_from_hf_config(TINY_CONFIGS[name]), 2)


def test_batch_invariant_mode_says_latent_attention_lacks_its_kernel(deepseek):
    from genfast.llm.model.invariance import unavailable_reason

    assert "latent attention" in unavailable_reason(deepseek[1])


def test_glm_gguf_leaves_out_the_multi_token_prediction_layers():
    """llama.cpp counts GLM-4.5's MTP layer in block_count; genfast builds the main layers only."""
    from genfast.llm.model.families import glm4_moe

    meta = {"glm4moe.block_count": 47, "glm4moe.nextn_predict_layers": 1, "glm4moe.expert_count": 128}
    fields = glm4_moe.gguf_fields(meta, "glm4moe", {"blk.0.attn_q_norm.weight"})
    assert fields["n_layers"] == 46 and fields["family_args"].qk_norm
    assert not glm4_moe.gguf_fields(meta, "glm4moe", set())["family_args"].qk_norm
