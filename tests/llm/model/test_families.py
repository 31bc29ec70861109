"""Each decoder family beyond the Llama-shaped ones (genfast/llm/model/families/) on a tiny random
transformers model: logits from safetensors and from a GGUF in llama.cpp's layout equal
transformers' (fp32, 1e-4), greedy text through the CLI equals transformers' generate, compiled
equals eager without recompiling, and int8/int4 stay within their budgets. (Tensor parallelism:
tests/llm/test_tensor_parallel.py; the shared families: tests/llm/model/test_model_vs_hf.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genfast import cli
from genfast.errors import UserError
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.quantize import quantize_loaded
from genfast.llm.checkpoints.tokenizer import load_tokenizer
from genfast.llm.checkpoints.weights import load_model
from genfast.llm.decoding.drafters import LayerDrafter
from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.precompiled import attach
from genfast.llm.decoding.sampling import SamplingParams
from genfast.llm.decoding.speculative import MAX_K, SpeculativeGenerator
from genfast.llm.loading import load
from genfast.llm.model import families
from genfast.llm.model.layers import WINDOW_SLACK, WindowKVCache
from genfast.llm.model.reading import args_from_hf_config
from genfast.llm.tensor_parallel import shard_model
from tests.llm.decoding.test_generate import check_compiled_matches_eager
from tests.llm.gguf_fixtures import write_gguf_from_hf
from tests.llm.hf_fixtures import TINY_CONFIGS, make_hf_model, save_hf_model, word_tokenizer

ATOL = 1e-4
# (TINY_CONFIGS name, GGUF architecture)
FAMILIES = [
    ("qwen3", "qwen3"),
    ("phi3", "phi3"),
    ("phi3_longrope", "phi3"),
    ("gemma2", "gemma2"),
    ("gemma3", "gemma3"),
    ("mixtral", "llama"),  # llama.cpp writes Mixtral as "llama" with an expert count
    ("qwen3_moe", "qwen3moe"),
    ("smollm3", "smollm3"),
    ("seed_oss", "seed_oss"),
    ("olmo2", "olmo2"),
    ("olmo3", "olmo2"),  # llama.cpp writes OLMo 3 as "olmo2" with a window and a layer pattern
    ("granite", "granite"),
    ("ernie4_5", "ernie4_5"),
    ("exaone4", "exaone4"),
    ("glm4", "glm4"),
    ("hunyuan_dense", "hunyuan-dense"),
    ("deepseek_v3", "deepseek2"),  # its own pieces: test_deepseek.py
    ("glm4_moe", "glm4moe"),
]
# Budgets on the tiny random models: the mean KL divergence of the next-token distributions,
# and the relative logit error ||quantized - fp32|| / ||fp32|| as a guard against gross breakage
# (the random models' logits are nearly flat, std ~0.16 for gemma3, which inflates it).
# Measured (int8 / int4): llama3 0.012 / 0.108 and KL 0 / 1.4e-4; qwen3 0.017 / 0.126; phi3
# 0.010 / 0.083; gemma2 0.028 / 0.254 and KL 1e-5 / 8.6e-4; gemma3 0.036 / 0.331 and KL 1.7e-5 /
# 1.4e-3.
BUDGET = {"int8": (0.08, 1e-4), "int4": (0.5, 3e-3)}


def saved_family(name: str, parent: Path, **changes) -> tuple[str, object, Path]:
    """(name, transformers model, its saved directory with a word tokenizer); `changes`: config fields."""
    hf = make_hf_model(name, **changes)
    directory = save_hf_model(hf, parent / name)
    word_tokenizer(hf.config.vocab_size).save(directory)
    return name, hf, directory


@pytest.fixture(scope="module", params=[name for name, _ in FAMILIES])
def family_model(request, tmp_path_factory) -> tuple[str, object, Path]:
    return saved_family(request.param, tmp_path_factory.mktemp(request.param))


def _tokens(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def test_logits_from_safetensors_and_gguf_equal_transformers(family_model, tmp_path):
    name, hf, directory = family_model
    arch = dict(FAMILIES)[name]
    tokens = _tokens(hf.config.vocab_size, 23)
    with torch.no_grad():
        expected = hf(tokens).logits
        for source, names in (
            (directory, TINY_CONFIGS[name]["model_type"]),
            (write_gguf_from_hf(hf, tmp_path / f"{name}.gguf", arch=arch), arch),
        ):
            model = load_model(Checkpoint.open(source))
            assert families.family(model.args.family) is families.family(names)
            torch.testing.assert_close(model(tokens, torch.arange(23), all_logits=True), expected, atol=ATOL, rtol=0)


def check_cli_greedy_equals_transformers(hf, directory: Path, prompt: list[int], new_tokens: int, capsys) -> str:
    """`genfast generate --dtype float32 --no-compile` on `prompt` (word-tokenizer text) prints the
    text of transformers' greedy `new_tokens`; returns what it wrote to stderr."""
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()  # fmt: skip
    tokenizer = load_tokenizer(Checkpoint.open(directory))
    text = " ".join(f"w{i}" for i in prompt)
    argv = ["generate", text, "--model", str(directory), "--dtype", "float32", "-n", str(new_tokens), "--no-compile",
            "--quiet"]  # fmt: skip
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip() == tokenizer.decode(want).strip()
    return err


def test_greedy_text_through_the_cli_equals_transformers(family_model, capsys):
    _, hf, directory = family_model
    prompt = _tokens(hf.config.vocab_size, 7, seed=1)[0].tolist()
    check_cli_greedy_equals_transformers(hf, directory, prompt, 10, capsys)


@pytest.fixture
def fresh_dynamo():
    """Each family's graphs are compiled for the same step functions: dropped afterwards, so that the
    families do not add up to dynamo's per-function recompile limit for the tests that follow."""
    yield
    torch._dynamo.reset()


# EXAONE 4.0 32B's layout: local layers (a 6-token window here) rotate, the global ones do not.
EXAONE4_HYBRID = dict(num_hidden_layers=2, sliding_window=6, layer_types=["sliding_attention", "full_attention"])

# The compile tests' models keep one layer of each kind a family has, and no more: compiling is most
# of these tests' time (cold, on a 2-core Xeon: gemma3's two compile tests took 142 s with six
# layers, 87 s with two).
COMPILED_LAYERS = {
    "gemma2": dict(num_hidden_layers=2),  # local, global
    "gemma3": dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]),
    "qwen3_moe": dict(num_hidden_layers=2),  # experts, dense (mlp_only_layers)
    "deepseek_v3": dict(num_hidden_layers=2),  # dense, experts
    "glm4_moe": dict(num_hidden_layers=2),  # dense, experts
    "smollm3": dict(num_hidden_layers=2, no_rope_layer_interval=2),  # rotary, NoPE
    "exaone4": EXAONE4_HYBRID,  # local and rotary, global and NoPE
}


# Families whose modules are another's, with other values (biases, q/k row order, windows): their
# compiled steps are that family's code, compiled by its tests; compiling them again would only
# add minutes to the suite.
COMPILED_AS = {
    "seed_oss": "qwen2 in tests/llm/decoding/test_generate.py: Llama's modules with q/k/v biases",
    "ernie4_5": "Llama's modules; only the loader reorders q/k rows",
    "olmo3": "olmo2's modules with a window on some layers, as gemma2's local layers",
    "smollm3": "exaone4's NoPE layers (NoPEAttention)",
}


@pytest.fixture
def compiled_family(family_model, tmp_path) -> tuple[str, object, Path]:
    name = family_model[0]
    if name in COMPILED_AS:
        pytest.skip(f"compiled as {COMPILED_AS[name]}")
    return saved_family(name, tmp_path, **COMPILED_LAYERS[name]) if name in COMPILED_LAYERS else family_model


def test_compiled_equals_eager_without_recompiling(compiled_family, fresh_dynamo):
    _, hf, directory = compiled_family
    check_compiled_matches_eager(load_model(Checkpoint.open(directory)), word_tokenizer(hf.config.vocab_size))


# Saving and loading compiled steps depends on what the graphs hold (their caches, ops and
# guards), not on a family's values: one family per kind of graph, beside Llama's modules
# (tests/llm/decoding/test_precompiled.py). The others' graphs are checked compiled above.
SAVED_STEPS_FAMILIES = {
    "gemma2": "sliding-window ring caches beside full ones, soft-capped logits",
    "exaone4": "NoPE layers among local rotary ones, post-norms",
    "phi3_longrope": "LongRoPE's factors switched by the sequence length",
    "qwen3_moe": "routed experts beside a dense layer",
    "deepseek_v3": "multi-head latent attention's compressed cache, shared experts",
}


def test_saved_compiled_steps_load_and_give_the_eager_tokens(compiled_family, fresh_dynamo):
    """The steps `genfast generate` saves (aot_compile, genfast/llm/decoding/precompiled.py) for this family:
    compiled and saved by one generator, loaded by a fresh one, which then matches eager."""
    name, _, directory = compiled_family
    if name not in SAVED_STEPS_FAMILIES:
        pytest.skip("its graphs hold what another family's saved steps hold (SAVED_STEPS_FAMILIES)")
    loaded = load(str(directory), "cpu", "float32")
    prompt = [3, 4, 5, 6]
    want = Generator(loaded.model, loaded.tokenizer, max_seq_len=64, compile=False).generate(
        [prompt], 20, stop_at_eos=False
    )
    first = Generator(loaded.model, loaded.tokenizer, max_seq_len=64, compile=True)
    attach(first, loaded, SamplingParams(), lambda m: None)
    first.warmup()  # compiles and saves
    again = load(str(directory), "cpu", "float32")
    second = Generator(again.model, again.tokenizer, max_seq_len=64, compile=True)
    steps = attach(second, again, SamplingParams(), lambda m: None)
    assert steps.start().startswith("loaded the compiled steps")
    assert second.generate([prompt], 20, stop_at_eos=False).token_ids == want.token_ids
    assert steps._checked == {"prefill", "decode"}


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_logits_stay_within_budget(family_model, quant):
    _, hf, directory = family_model
    tokens = _tokens(hf.config.vocab_size, 17, seed=2)
    with torch.no_grad():
        checkpoint = Checkpoint.open(directory)
        reference = load_model(checkpoint)(tokens, torch.arange(17), all_logits=True)
        model = load_model(checkpoint)
        quantize_loaded(checkpoint, model, 8 if quant == "int8" else 4, None)
        got = model(tokens, torch.arange(17), all_logits=True)
    error = float((got - reference).norm() / reference.norm())
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none")
    max_error, max_kl = BUDGET[quant]
    assert error <= max_error, f"{quant}: relative logit error {error:.4f}"
    assert float(kl.sum(-1).mean()) <= max_kl, f"{quant}: mean KL {float(kl.sum(-1).mean()):.2e}"


def test_every_family_is_registered_under_the_names_checkpoints_use():
    assert set(TINY_CONFIGS[name]["model_type"] for name, _ in FAMILIES) <= set(families.hf_model_types())
    assert {arch for _, arch in FAMILIES} <= set(families.gguf_architectures())
    assert families.family("mistral") is families.family("llama")
    with pytest.raises(UserError, match="unsupported architecture 'gpt_neox'"):
        args_from_hf_config({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]})


def greedy_per_transformers(hf, prompt: list[int], generated: list[int]) -> bool:
    """Whether every generated token is transformers' greedy choice after its prefix (one forward
    over the whole sequence), up to ties within 1e-4: random models' flat, soft-capped logits
    have near-ties that decide generate()'s cached steps and a full forward differently."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    chosen = logits.gather(-1, torch.tensor(generated)[:, None])[:, 0]
    return bool((logits.max(-1).values - chosen <= 1e-4).all())


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral_window", "olmo3"])
def test_local_layers_keep_a_ring_of_their_window(name, tmp_path, fresh_dynamo):
    """Local layers (Gemma's and OLMo 3's; all of Mistral v0.1's) cache window + WINDOW_SLACK slots whatever the
    context, which goes on past the window. A prompt longer than
    the ring and a generation that wraps it many times are transformers' greedy tokens, and a
    left-padded batch, speculative decoding (rejected drafts are written into the ring and must
    not evict keys still in the window) and compiled decoding (for one family) give the same tokens."""
    hf = make_hf_model(name)
    model = load_model(Checkpoint.open(save_hf_model(hf, tmp_path / name)))
    tok = word_tokenizer(hf.config.vocab_size)
    window = hf.config.sliding_window
    prompts = [_tokens(hf.config.vocab_size, n, seed=n)[0].tolist() for n in (50, 9)]
    eager = Generator(model, tok, max_seq_len=128, max_batch_size=2, compile=False)
    rings = [layer.attention.kv_cache for layer in model.layers if layer.attention.sliding_window]
    assert rings and all(isinstance(c, WindowKVCache) and c.k.shape[2] == window + WINDOW_SLACK + 1 for c in rings)
    want = [eager.generate([p], 60, stop_at_eos=False).token_ids[0] for p in prompts]
    assert all(greedy_per_transformers(hf, p, w) for p, w in zip(prompts, want, strict=True))
    assert eager.generate(prompts, 60, stop_at_eos=False).token_ids == want  # left-padded batch
    spec = SpeculativeGenerator(model, tok, LayerDrafter(1), k=MAX_K, max_seq_len=128, compile=False)
    assert spec.generate([prompts[0]], 60, stop_at_eos=False).token_ids[0] == want[0]
    if name == "mistral_window":  # the ring's compiled code is the same for every family: compiled once
        compiled = Generator(model, tok, max_seq_len=128, compile=True)
        assert compiled.generate([prompts[1]], 60, stop_at_eos=False).token_ids[0] == want[1]


@pytest.mark.parametrize(
    "changes, nope", [(dict(no_rope_layers=[0, 1, 1, 0]), (0, 3)), (dict(no_rope_layer_interval=2), (1, 3))]
)
def test_smollm3_takes_its_nope_layers_from_the_config(changes, nope, tmp_path):
    """The NoPE layers as a list (1: the layer rotates) or as an interval, and logits equal transformers'."""
    hf = make_hf_model("smollm3", **changes)
    model = load_model(Checkpoint.open(save_hf_model(hf, tmp_path / "smollm3")))
    assert model.args.family_args.nope_layers == nope
    tokens = _tokens(hf.config.vocab_size, 19)
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens, torch.arange(19), all_logits=True), hf(tokens).logits, atol=ATOL, rtol=0
        )


def test_tensor_parallelism_refuses_norms_over_all_heads(tmp_path):
    """OLMo 2 normalizes q and k over every head at once: a rank with half the heads cannot."""
    model = load_model(Checkpoint.open(save_hf_model(make_hf_model("olmo2"), tmp_path / "olmo2")))
    with pytest.raises(UserError, match=r"--tp 2: olmo2 models do not run tensor-parallel yet \(.* span all heads"):
        shard_model(model, 0, 2)


def test_a_hybrid_exaone4_keeps_positions_out_of_its_global_layers(tmp_path):
    """EXAONE 4.0 32B's layout: the local layers rotate and attend within their window, the global
    ones neither; a sequence longer than the window, logits equal transformers'."""
    hf = make_hf_model("exaone4", **{**EXAONE4_HYBRID, "num_hidden_layers": 4, "layer_types": None})
    model = load_model(Checkpoint.open(save_hf_model(hf, tmp_path / "exaone4")))
    own = model.args.family_args
    assert (own.sliding_layers, own.nope_layers, own.sliding_window) == ((0, 1, 2), (3,), 6)
    tokens = _tokens(hf.config.vocab_size, 19)
    with torch.no_grad():
        got, want = model(tokens, torch.arange(19), all_logits=True), hf(tokens).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
