"""gpt-oss (genfast/llm/model/families/gpt_oss.py) on a tiny random transformers model: 32 experts,
top-4, alternating 8-token sliding and full layers (the test prompts are longer than the ring),
YaRN, attention sinks, expert biases and the clamped SwiGLU with weights large enough to clamp.
Logits from safetensors (unquantized and MXFP4), from GGUF (F32 and MXFP4 experts) equal
transformers' (fp32, 1e-4); greedy text through the CLI, the ring, batches, speculative decoding,
compiled decoding and the serve engine give transformers' tokens; int8/int4 stay within budget."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from genfast import cli
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.quantize import quantize_loaded
from genfast.llm.checkpoints.weights import load_model
from genfast.llm.decoding.drafters import LayerDrafter
from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.speculative import MAX_K, SpeculativeGenerator
from genfast.llm.decoding.stats import weight_bytes_per_step
from genfast.llm.model import families
from genfast.llm.model.families.gpt_oss import GptOssExperts, attention_with_sinks
from genfast.llm.model.layers import WINDOW_SLACK, KVCache, WindowKVCache
from genfast.quant.mxfp4 import MXFP4ExpertLinear
from genfast.serve.engine import Engine, GenerationRequest
from tests.llm.decoding.test_generate import check_compiled_matches_eager
from tests.llm.hf_fixtures import hf_model_from_config, save_hf_model, word_tokenizer
from tests.llm.model.test_families import BUDGET, check_cli_greedy_equals_transformers, greedy_per_transformers
from tests.serve.test_engine import run_concurrently

ATOL = 1e-4
WINDOW = 8
CONFIG = dict(
    model_type="gpt_oss",
    architectures=["GptOssForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,  # sliding, full, sliding, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=WINDOW,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    # YaRN as the published models have it (not truncated), scaled to the tiny context.
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=64,
    ),
)


def make_gpt_oss(seed: int = 0, **changes):
    """The tiny model with weights that exercise what gpt-oss adds: non-zero biases and sinks,
    clear router choices, and expert weights large enough that gate and up cross the clamp."""
    hf = hf_model_from_config({**CONFIG, **changes}, seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                p.add_(torch.randn_like(p) * 0.5)
            if name.endswith("router.weight"):
                p.normal_(0, 1.0)
            if name.endswith(("gate_up_proj", "down_proj")):
                p.normal_(0, 0.6)
    return hf.eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[object, Path]:
    """(transformers model, its saved directory with a word tokenizer)."""
    hf = make_gpt_oss()
    directory = save_hf_model(hf, tmp_path_factory.mktemp("gpt_oss") / "hf")
    word_tokenizer(hf.config.vocab_size).save(directory)
    return hf, directory


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


# ---- MXFP4 in both layouts, by the gguf package's quantizer (llama.cpp's arithmetic) -------------


def mxfp4_gguf_bytes(weight: torch.Tensor) -> np.ndarray:
    """[..., out, in] fp32 as GGUF MXFP4 rows: [..., out, in / 32 * 17] uint8."""
    import gguf

    data = weight.detach().float().numpy()
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType.MXFP4)


def mxfp4_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """What `weight` [..., out, in] becomes through MXFP4."""
    import gguf

    packed = mxfp4_gguf_bytes(weight)
    return torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.MXFP4)).reshape(weight.shape)


def mxfp4_hf(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [..., out, in] as Hugging Face's blocks [..., out, in / 32, 16] and scales
    [..., out, in / 32]: the same codes and e8m0 scales as GGUF's, the nibbles of byte j holding
    elements 2j (low) and 2j + 1 (high) where GGUF's hold j and j + 16."""
    packed = torch.from_numpy(mxfp4_gguf_bytes(weight).copy())
    groups = packed.reshape(*weight.shape[:-1], weight.shape[-1] // 32, 17)
    scales, nibbles = groups[..., 0], groups[..., 1:]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # element order 0..31
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), scales.contiguous()


def experts_through_mxfp4(hf) -> None:
    """Replace the transformers model's expert weights by their MXFP4 round trip, in place."""
    with torch.no_grad():
        for layer in hf.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.copy_(mxfp4_dequantized(p.transpose(1, 2)).transpose(1, 2))


# ---- GGUF as llama.cpp's converter writes gpt-oss ----------------------------------------------


def write_gpt_oss_gguf(hf, path: Path, experts: str = "F32") -> Path:
    """A GGUF of the model laid out as llama.cpp's converter does for gpt-oss (gate and up split
    from their interleaving, experts [E, out, in], `experts` "F32" or "MXFP4")."""
    import gguf

    cfg = hf.config
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_vocab_size(cfg.vocab_size)
    tokens = [f"<t{i}>" for i in range(cfg.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])

    def add(name: str, tensor: torch.Tensor) -> None:
        w.add_tensor(name, tensor.detach().float().contiguous().numpy())

    def add_experts(name: str, weight: torch.Tensor) -> None:  # [E, out, in]
        if experts == "MXFP4":
            w.add_tensor(name, mxfp4_gguf_bytes(weight), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            add(name, weight)

    add("token_embd.weight", hf.model.embed_tokens.weight)
    add("output_norm.weight", hf.model.norm.weight)
    add("output.weight", hf.lm_head.weight)
    for i, layer in enumerate(hf.model.layers):
        attn, mlp, b = layer.self_attn, layer.mlp, f"blk.{i}."
        for ours, theirs in (("attn_q", attn.q_proj), ("attn_k", attn.k_proj), ("attn_v", attn.v_proj),
                             ("attn_output", attn.o_proj)):  # fmt: skip
            add(b + ours + ".weight", theirs.weight)
            add(b + ours + ".bias", theirs.bias)
        add(b + "attn_sinks.weight", attn.sinks)
        add(b + "attn_norm.weight", layer.input_layernorm.weight)
        add(b + "post_attention_norm.weight", layer.post_attention_layernorm.weight)
        add(b + "ffn_gate_inp.weight", mlp.router.weight)
        add(b + "ffn_gate_inp.bias", mlp.router.bias)
        gate_up = mlp.experts.gate_up_proj.transpose(1, 2)  # [E, 2I, H], gate and up interleaved
        add_experts(b + "ffn_gate_exps.weight", gate_up[:, 0::2])
        add_experts(b + "ffn_up_exps.weight", gate_up[:, 1::2])
        add_experts(b + "ffn_down_exps.weight", mlp.experts.down_proj.transpose(1, 2))
        add(b + "ffn_gate_exps.bias", mlp.experts.gate_up_proj_bias[:, 0::2])
        add(b + "ffn_up_exps.bias", mlp.experts.gate_up_proj_bias[:, 1::2])
        add(b + "ffn_down_exps.bias", mlp.experts.down_proj_bias)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def save_mxfp4_checkpoint(hf, directory: Path) -> Path:
    """`hf` saved as the published gpt-oss checkpoints are: experts as MXFP4 `_blocks` and
    `_scales` ([E, out, in / 32, 16] and [E, out, in / 32]), the rest as it is."""
    from safetensors.torch import load_file, save_file

    save_hf_model(hf, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        blocks, scales = mxfp4_hf(tensors.pop(name).transpose(1, 2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# ---- tests ---------------------------------------------------------------------------------------


def test_logits_from_safetensors_and_gguf_equal_transformers(gpt_oss, tmp_path):
    hf, directory = gpt_oss
    tokens = _tokens(23)  # longer than the window
    with torch.no_grad():
        expected = hf(tokens).logits
        for source in (directory, write_gpt_oss_gguf(hf, tmp_path / "gpt-oss.gguf")):
            model = load_model(Checkpoint.open(source))
            assert families.family(model.args.family) is families.family("gpt_oss")
            assert model.args.family_args.sliding_layers == (0, 2)
            torch.testing.assert_close(model(tokens, torch.arange(23), all_logits=True), expected, atol=ATOL, rtol=0)
        # The fixture's weights reach the clamp: without it the logits differ.
        for layer in model.layers:
            layer.feed_forward.limit = float("inf")
        assert (model(tokens, torch.arange(23), all_logits=True) - expected).abs().max() > 1e-2


def test_a_decode_step_reads_k_of_e_experts_with_their_biases(gpt_oss):
    model = load_model(Checkpoint.open(gpt_oss[1]))
    ffns = [layer.feed_forward for layer in model.layers]
    stacked = sum(f.w13.weight.nbytes + f.w2.weight.nbytes + f.w13_bias.nbytes + f.w2_bias.nbytes for f in ffns)
    # A batch of 8 runs 32 of the 32 experts: all of them; one sequence 4.
    assert weight_bytes_per_step(model, batch_size=8) - weight_bytes_per_step(model) == stacked * 28 // 32


def check_mxfp4_model(model, hf, tokens: torch.Tensor) -> None:
    """`model`'s experts are MXFP4 codes; its logits equal transformers' on the dequantized weights
    through the experts' portable path (which dequantizes them exactly). Where the native kernel
    runs (it quantizes the activations to int8 per block of 32), each stack's outputs stay within
    2% of the portable path's (the random model's near-tied routing amplifies that in its logits)."""
    stacks = [m for m in model.modules() if isinstance(m, MXFP4ExpertLinear)]
    assert len(stacks) == 2 * CONFIG["num_hidden_layers"]
    rows = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    experts = torch.arange(64) % 32
    for stack in stacks:
        x = rows[:, : stack.in_features]
        native = stack(x, experts)
        stack.kernel_ready = False
        portable = stack(x, experts)
        assert float((native - portable).norm() / portable.norm()) < 0.02
    with torch.no_grad():
        got = model(tokens, torch.arange(tokens.shape[1]), all_logits=True)
        torch.testing.assert_close(got, hf(tokens).logits, atol=ATOL, rtol=0)


def test_mxfp4_experts_from_gguf_equal_transformers_on_the_dequantized_weights(tmp_path):
    hf = make_gpt_oss(seed=1)
    path = write_gpt_oss_gguf(hf, tmp_path / "gpt-oss-mxfp4.gguf", experts="MXFP4")
    checkpoint = Checkpoint.open(path)
    assert checkpoint.gguf.tensor_type("blk.0.ffn_gate_exps.weight") == "MXFP4"
    gate = hf.model.layers[0].mlp.experts.gate_up_proj.transpose(1, 2)[:, 0::2]
    torch.testing.assert_close(checkpoint.gguf.tensor("blk.0.ffn_gate_exps.weight"), mxfp4_dequantized(gate))
    model = load_model(checkpoint)
    experts_through_mxfp4(hf)
    check_mxfp4_model(model, hf, _tokens(19, seed=3))


def test_mxfp4_safetensors_equal_transformers_on_the_dequantized_weights(tmp_path):
    hf = make_gpt_oss(seed=2)
    checkpoint = Checkpoint.open(save_mxfp4_checkpoint(hf, tmp_path / "mxfp4"))
    model = load_model(checkpoint)
    experts_through_mxfp4(hf)
    check_mxfp4_model(model, hf, _tokens(19, seed=4))
    # int8 quantizes the rest and leaves the MXFP4 codes as they are.
    replaced = quantize_loaded(checkpoint, model, 8, None)
    assert "layers.0.attention.wqkv" in replaced and not any("feed_forward.w" in name for name in replaced)
    assert isinstance(model.layers[0].feed_forward.w13, MXFP4ExpertLinear)


def test_sinks_take_their_share_in_both_attention_paths():
    """One query (explicit path) and several (SDPA with a sink column) agree with a plain softmax
    over [scores, sink], grouped heads, a boolean mask with hidden keys, and a fully masked row."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    mask = torch.rand(2, 1, 5, 9) > 0.3
    mask[1, 0, 2] = False  # nothing visible: all the mass on the sink, output zero
    sinks = torch.randn(4) * 2
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(2, 3)) * 0.25
    scores = scores.masked_fill(~mask, float("-inf"))
    full = torch.cat([scores, sinks.view(1, 4, 1, 1).expand(2, 4, 5, 1)], dim=-1).softmax(-1)[..., :-1]
    want = full @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(attention_with_sinks(q, k, v, mask, sinks, 0.25), want)
    for s in range(5):
        one = attention_with_sinks(q[:, :, s : s + 1], k, v, mask[:, :, s : s + 1], sinks, 0.25)
        torch.testing.assert_close(one, want[:, :, s : s + 1])
    assert want[1, :, 2].abs().max() == 0


def test_expert_activation_equals_transformers(tmp_path):
    """gate and up de-interleaved, the clamps, (up + 1) * gate * sigmoid(alpha * gate), biases per row."""
    hf = make_gpt_oss()
    theirs = hf.model.layers[0].mlp.experts
    x = torch.randn(40, 64) * 3
    experts = torch.randint(0, 32, (40,))
    model = load_model(Checkpoint.open(save_hf_model(hf, tmp_path / "m")))
    ours = model.layers[0].feed_forward
    assert isinstance(ours, GptOssExperts)
    with torch.no_grad():
        want = torch.stack(
            [
                theirs._apply_gate(x[r] @ theirs.gate_up_proj[e] + theirs.gate_up_proj_bias[e]) @ theirs.down_proj[e]
                + theirs.down_proj_bias[e]
                for r, e in enumerate(experts.tolist())
            ]
        )
        torch.testing.assert_close(ours.experts(x, experts), want, atol=1e-4, rtol=1e-5)


def test_greedy_text_through_the_cli_equals_transformers(gpt_oss, capsys):
    hf, directory = gpt_oss
    prompt = _tokens(12, seed=1)[0].tolist()  # the generation runs well past the window
    check_cli_greedy_equals_transformers(hf, directory, prompt, 16, capsys)


def test_the_ring_batches_and_speculative_decoding_give_transformers_tokens(gpt_oss):
    """Sliding layers cache a ring of window + WINDOW_SLACK slots; a prompt longer than the ring and
    a generation that wraps it are transformers' greedy tokens, and so are a left-padded batch,
    speculative decoding (drafts by the first layers, rejected ones written into the ring) and the
    serve engine's continuous batching (rows at their own positions)."""
    hf, directory = gpt_oss
    model = load_model(Checkpoint.open(directory))
    tok = word_tokenizer(hf.config.vocab_size)
    prompts = [_tokens(n, seed=n)[0].tolist() for n in (45, 9)]
    eager = Generator(model, tok, max_seq_len=128, max_batch_size=2, compile=False)
    kinds = [type(layer.attention.kv_cache) for layer in model.layers]
    assert kinds == [WindowKVCache, KVCache, WindowKVCache, KVCache]
    assert model.layers[0].attention.kv_cache.k.shape[2] == WINDOW + WINDOW_SLACK + 1
    want = [eager.generate([p], 40, stop_at_eos=False).token_ids[0] for p in prompts]
    assert all(greedy_per_transformers(hf, p, w) for p, w in zip(prompts, want, strict=True))
    assert eager.generate(prompts, 40, stop_at_eos=False).token_ids == want  # left-padded batch
    spec = SpeculativeGenerator(model, tok, LayerDrafter(2), k=MAX_K, max_seq_len=128, compile=False)
    assert spec.generate([prompts[0]], 40, stop_at_eos=False).token_ids[0] == want[0]

    engine = Engine(model, tok, max_batch=2, max_seq_len=128, compile=False).start()
    try:
        results = run_concurrently(engine, [GenerationRequest(tuple(p), 40) for p in prompts])
        assert [r.token_ids for r in results] == want
    finally:
        engine.shutdown()


@pytest.fixture
def fresh_dynamo():
    """Compiled graphs dropped afterwards, so later tests do not hit dynamo's recompile limit."""
    yield
    torch._dynamo.reset()


def test_compiled_equals_eager_without_recompiling(tmp_path, fresh_dynamo):
    hf = make_gpt_oss(num_hidden_layers=2)  # one layer of each kind: compiling is most of the time
    model = load_model(Checkpoint.open(save_hf_model(hf, tmp_path / "two")))
    check_compiled_matches_eager(model, word_tokenizer(hf.config.vocab_size))


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_logits_stay_within_budget(gpt_oss, quant):
    """The experts' stacks, attention and head quantize; biases, sinks and the router stay float."""
    _, directory = gpt_oss
    tokens = _tokens(17, seed=2)
    with torch.no_grad():
        checkpoint = Checkpoint.open(directory)
        reference = load_model(checkpoint)(tokens, torch.arange(17), all_logits=True)
        model = load_model(checkpoint)
        replaced = quantize_loaded(checkpoint, model, 8 if quant == "int8" else 4, None)
        assert "layers.0.feed_forward.w13" in replaced and "layers.0.attention.wqkv" in replaced
        got = model(tokens, torch.arange(17), all_logits=True)
    error = float((got - reference).norm() / reference.norm())
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none")
    max_error, max_kl = BUDGET[quant]
    assert error <= max_error, f"{quant}: relative logit error {error:.4f}"
    assert float(kl.sum(-1).mean()) <= max_kl, f"{quant}: mean KL {float(kl.sum(-1).mean()):.2e}"


@pytest.mark.parametrize(
    "rope",
    [
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
        dict(factor=32.0, truncate=True, original_max_position_embeddings=4096),  # llama.cpp's rounding
        dict(factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096),  # DeepSeek's
        dict(factor=4.0, attention_factor=1.5, beta_fast=16.0, beta_slow=2.0, original_max_position_embeddings=64),
    ],
)
def test_yarn_frequencies_and_scale_equal_transformers(rope):
    """The real models' head size and base, read from a config and computed as transformers' rope init does."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from genfast.llm.model.config import rope_inverse_frequencies
    from genfast.llm.model.reading import args_from_hf_config

    parameters = dict(rope_type="yarn", rope_theta=150000.0, **rope)
    config = transformers.GptOssConfig(head_dim=64, max_position_embeddings=131072, rope_parameters=parameters)
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    args = args_from_hf_config(config.to_dict())
    got = torch.tensor(rope_inverse_frequencies(args), dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert args.rope_scaling.attention_factor == pytest.approx(want_scale, rel=1e-9)


def test_a_saved_config_reads_back_equal(gpt_oss):
    from genfast.llm.model.reading import args_from_dict

    args = Checkpoint.open(gpt_oss[1]).args
    assert args_from_dict(json.loads(json.dumps(args.to_dict()))) == args


def test_tensor_parallel_is_refused_with_the_reason(gpt_oss, capsys):
    """Before any rank starts: sinks, expert biases and MXFP4 stacks have no sharding yet."""
    argv = ["generate", "w1 w2", "--model", str(gpt_oss[1]), "--dtype", "float32", "--no-compile", "--tp", "2"]
    assert cli.main(argv) != 0
    err = capsys.readouterr().err
    assert "--tp 2: gpt_oss models do not run tensor-parallel yet" in err and "--tp 1" in err
