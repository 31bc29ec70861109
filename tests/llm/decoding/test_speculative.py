"""Speculative and prompt-lookup decoding: greedy output equals plain decoding, sampled output
follows the target's distribution, caches stay consistent, stats and errors."""

import itertools

import pytest
import torch

from genfast.errors import UserError
from genfast.llm.decoding.drafters import LayerDrafter, ModelDrafter, PromptLookupDrafter, parse_draft
from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.sampling import SamplingParams, probabilities
from genfast.llm.decoding.speculative import SpeculativeGenerator, accept_drafts
from genfast.llm.model.config import ModelArgs
from genfast.llm.model.transformer import Transformer
from tests.llm.hf_fixtures import tiny_genfast_model, word_tokenizer


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against a distribution; outcomes expected fewer than 5
    times are pooled into one bin (the test's usual validity condition)."""
    n = counts.sum()
    expected = expected_probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.fixture
def one_thread():
    """Tiny models in a loop: one thread avoids OpenMP's per-op hand-offs (~10x faster here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_markov(vocab: int, seed: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, vocab, generator=g) * sharpness).softmax(-1)  # [prev, next]


def test_acceptance_rule_reproduces_the_target_distribution(one_thread):
    """The rule alone, with a Markov chain as the target and another as the draft: the first two
    tokens produced (accepted drafts, residual or bonus draws, over rounds) follow the target's
    joint distribution; the draft's own joint is rejected by the same test (the test has power)."""
    vocab, k, samples = 6, 3, 20_000
    p_table, q_table = random_markov(vocab, 1, 1.5), random_markov(vocab, 2, 1.5)
    torch.manual_seed(0)
    counts = torch.zeros(vocab * vocab)
    for _ in range(samples):
        out, prev = [], 0
        while len(out) < 2:
            drafts, context = [], prev
            for _ in range(k):
                context = int(torch.multinomial(q_table[context], 1))
                drafts.append(context)
            draft = torch.tensor(drafts)
            p = p_table[torch.tensor([prev, *drafts])]  # the target after each prefix
            n, nxt = accept_drafts(p, q_table[torch.tensor([prev, *drafts[:-1]])], draft)
            out += drafts[: int(n)] + [int(nxt)]
            prev = out[-1]
        counts[out[0] * vocab + out[1]] += 1
    target = (p_table[0][:, None] * p_table).flatten()
    draft_joint = (q_table[0][:, None] * q_table).flatten()
    assert chi_square_p_value(counts, target) > 1e-3
    assert chi_square_p_value(counts, draft_joint) < 1e-12


def test_greedy_acceptance_is_the_argmax_prefix():
    eye = torch.eye(5)
    p = eye[[2, 4, 1, 3]]  # target argmax after each prefix
    n, nxt = accept_drafts(p, eye[[2, 4, 0]], torch.tensor([2, 4, 0]))
    assert (int(n), int(nxt)) == (2, 1)  # third draft rejected: the target's own token instead
    n, nxt = accept_drafts(p, eye[[2, 4, 1]], torch.tensor([2, 4, 1]))
    assert (int(n), int(nxt)) == (3, 3)  # all accepted, plus the bonus token


@pytest.fixture
def tiny(tmp_path):
    hf, model = tiny_genfast_model("llama3", tmp_path)
    return model, word_tokenizer(hf.config.vocab_size)


def noisy_copy(model: Transformer, noise: float, seed: int = 1) -> Transformer:
    """The model with its weights perturbed: a draft that agrees with it only partly."""
    copy = Transformer(model.args)
    copy.load_state_dict(model.state_dict())
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn_like(p) * p.std() * noise)
    return copy.eval()


@pytest.mark.parametrize("kind", ["model", "layers", "lookup"])
def test_greedy_equals_plain_decoding_on_a_tiny_model(tiny, kind):
    model, tok = tiny
    plain = Generator(model, tok, max_seq_len=64, compile=False)
    drafter = {
        "model": ModelDrafter(noisy_copy(model, 0.1)),
        "layers": LayerDrafter(1),
        "lookup": PromptLookupDrafter(),
    }[kind]
    spec = SpeculativeGenerator(model, tok, drafter, k=3, max_seq_len=64, compile=False)
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]  # repeats, so prompt lookup finds matches
    for n in (1, 2, 23):
        want = plain.generate([prompt], n, stop_at_eos=False)
        got = spec.generate([prompt], n, stop_at_eos=False)
        assert got.token_ids == want.token_ids and got.texts == want.texts
    if kind != "lookup":  # model drafts propose every round
        assert got.drafted_tokens == 3 * got.target_passes
    if kind == "model":  # partial acceptance: the draft's cache is rewound and caught up
        assert 0 < got.acceptance_rate < 1, got.acceptance_rate
    # Near the end of the cache there is no room for k+1 slots: plain steps finish the job.
    long = list(range(10, 60))
    assert (
        spec.generate([long], 14, stop_at_eos=False).token_ids
        == plain.generate([long], 14, stop_at_eos=False).token_ids
    )


def test_a_perfect_draft_is_always_accepted_and_stops_mid_round(tiny):
    model, tok = tiny
    twin = Transformer(model.args)
    twin.load_state_dict(model.state_dict())
    spec = SpeculativeGenerator(model, tok, ModelDrafter(twin), k=4, max_seq_len=64, compile=False)
    prompt = [3, 1, 4, 1, 5]
    result = spec.generate([prompt], 21, stop_at_eos=False)
    assert result.acceptance_rate == 1.0 and result.tokens_per_pass == 5.0 and result.target_passes == 4
    assert result.decode_steps == 20 and len(result.token_ids[0]) == 21
    free = result.token_ids[0]
    tok.stop_ids = {free[7]}
    stopped = spec.generate([prompt], 21)
    assert stopped.token_ids[0] == free[: free.index(free[7])] and stopped.stop_reasons == ["eos"]


def small_vocab_model(seed: int, n_layers: int = 2) -> Transformer:
    args = ModelArgs(
        vocab_size=12, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, intermediate_size=64, max_seq_len=64
    )
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        model.output.weight.mul_(4)  # peakier distributions: acceptances and rejections both happen
    return model.eval()


@pytest.mark.parametrize("kind", ["layers", "model", "lookup"])
def test_sampled_tokens_follow_the_target_distribution(kind, one_thread):
    """End to end on a 12-token model: 1,500 samples of the first 3 new tokens (top-k and
    temperature applied to target and draft alike). Tested against the target's exact
    distribution: the joint of tokens 1-2 and the marginal of token 3 (drawn within and across
    rounds), Pearson chi-square p > 0.001 at a fixed seed."""
    target = small_vocab_model(0)
    drafter = {
        "layers": LayerDrafter(1),
        "model": ModelDrafter(small_vocab_model(1, 1)),
        "lookup": PromptLookupDrafter(min_ngram=1),
    }[kind]
    params = SamplingParams(temperature=0.8, top_k=8)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]
    spec = SpeculativeGenerator(target, word_tokenizer(12), drafter, k=2, max_seq_len=16, compile=False)
    torch.manual_seed(0)
    counts = torch.zeros(12, 12, 12)
    drafted = accepted = 0
    for _ in range(1500):
        result = spec.generate([prompt], 3, params, stop_at_eos=False)
        t1, t2, t3 = result.token_ids[0]
        counts[t1, t2, t3] += 1
        drafted, accepted = drafted + result.drafted_tokens, accepted + result.accepted_tokens

    reference = Transformer(target.args)  # no cache: whole sequences at once
    reference.load_state_dict(target.state_dict())
    seqs = torch.tensor([prompt + list(c) for c in itertools.product(range(12), repeat=2)])
    with torch.no_grad():
        logits = reference(seqs, torch.arange(seqs.shape[1]), all_logits=True)[:, -3:]
    probs = probabilities(logits.reshape(-1, 12), params).reshape(144, 3, 12)
    joint12 = (probs[:, 0].gather(1, seqs[:, -2:-1]) * probs[:, 1].gather(1, seqs[:, -1:])).flatten()
    third = (joint12[:, None] * probs[:, 2]).sum(0)
    assert chi_square_p_value(counts.sum(2).flatten(), joint12) > 1e-3
    assert chi_square_p_value(counts.sum((0, 1)), third) > 1e-3
    assert 0.05 < accepted / drafted < 0.95  # acceptances and rejections both happened


def test_layer_drafter_shares_the_cache_and_checks_its_range(tiny):
    model, tok = tiny
    with pytest.raises(UserError, match="1 <= N < 2"):
        SpeculativeGenerator(model, tok, LayerDrafter(2), compile=False)
    spec = SpeculativeGenerator(model, tok, LayerDrafter(1), k=2, max_seq_len=32, compile=False)
    assert spec.drafter.steps.model is model


def test_errors_are_clear(tiny, tmp_path):
    model, tok = tiny
    _, other = tiny_genfast_model("qwen2", tmp_path)  # a different vocabulary
    with pytest.raises(UserError, match="vocabulary"):
        SpeculativeGenerator(model, tok, ModelDrafter(other), compile=False)
    with pytest.raises(UserError, match="--speculate-k"):
        SpeculativeGenerator(model, tok, PromptLookupDrafter(), k=0, compile=False)
    spec = SpeculativeGenerator(model, tok, PromptLookupDrafter(), compile=False)
    with pytest.raises(UserError, match="one prompt at a time"):
        spec.generate([[1, 2], [3, 4]], 4)
    for bad in ("int3", "layers:x", "model:", "prompt-lookup:3"):
        with pytest.raises(UserError):
            parse_draft(bad)
    assert parse_draft("layers:12") == ("layers", 12) and parse_draft("model:a:b") == ("model", "a:b")


def test_compiled_speculative_equals_eager(tmp_path):
    """The compiled verify, draft and plain steps give eager's greedy tokens; warmup compiles
    every graph generate() then uses (prompt lookup: whether or not its warm-up proposed)."""
    from torch._dynamo.utils import counters

    hf, model = tiny_genfast_model("qwen2", tmp_path)
    tok = word_tokenizer(hf.config.vocab_size)
    prompts = [[3, 4, 5, 6, 3, 4, 5, 7, 3, 4], [3, 4, 5, 6, 3, 4, 5]]
    for make in (PromptLookupDrafter, lambda: LayerDrafter(1)):  # lookup first: its graphs are all new
        eager = SpeculativeGenerator(model, tok, make(), k=3, max_seq_len=64, compile=False)
        compiled = SpeculativeGenerator(model, tok, make(), k=3, max_seq_len=64, compile=True)
        compiled.warmup()
        graphs = counters["stats"]["unique_graphs"]
        for prompt, n in zip(prompts, (20, 30)):
            want = eager.generate([prompt], n, stop_at_eos=False).token_ids
            assert compiled.generate([prompt], n, stop_at_eos=False).token_ids == want
        assert counters["stats"]["unique_graphs"] == graphs, "generate() compiled a graph warmup did not"
        assert compiled.guard_fallbacks == 0


@pytest.fixture(scope="module")
def smollm2_fp32(smollm2_gguf):
    from genfast.llm.loading import load

    loaded = load(str(smollm2_gguf), "cpu", "float32")
    plain = Generator(loaded.model, loaded.tokenizer, max_seq_len=256, compile=False)
    prompt = plain.encode_prompt("def fibonacci(n):\n    ")
    return loaded, prompt, plain.generate([prompt], 64, stop_at_eos=False).token_ids[0]


@pytest.mark.parametrize("draft", ["int4", "int8", "layers:20", "prompt-lookup", "model"])
def test_greedy_speculative_equals_plain_on_the_real_model(smollm2_fp32, smollm2_gguf, draft):
    """fp32, eager: a k+1-token verify pass rounds differently from a one-token step, but in fp32
    no argmax of these 64 tokens is close enough to a tie to flip (bf16: see docs/performance.md)."""
    from genfast.llm.recipe import make_generator

    loaded, prompt, want = smollm2_fp32
    spec = make_generator(loaded, 256, 1, False, f"model:{smollm2_gguf}" if draft == "model" else draft, 4)
    result = spec.generate([prompt], 64, stop_at_eos=False)
    assert result.token_ids[0] == want
    assert result.drafted_tokens > 0 and result.tokens_per_pass > 1


def test_cli_generate_with_prompt_lookup_prints_the_plain_completion_and_stats(smollm2_gguf, capsys):
    from genfast.cli import main

    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"
    base = ["generate", prompt, "--model", str(smollm2_gguf), "--no-compile", "--dtype", "float32", "-n", "16"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--prompt-lookup", "--speculate-k", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert "prompt lookup drafts 3 tokens" in captured.err and "speculative (k=3)" in captured.err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--speculate-k", "3"], "--speculate-k needs --draft"),
        (["--self-draft", "int3"], "unknown draft"),
        (["--self-draft", "prompt-lookup"], "--self-draft takes int4, int8 or layers:N"),
        (["--self-draft", "layers:30"], "1 <= N < 30"),
        (["--prompt-lookup", "--speculate-k", "17"], "between 1 and 16"),
        (["second prompt", "--prompt-lookup"], "one prompt at a time"),
        (["--draft", "/nonexistent/draft.gguf"], "model not found: /nonexistent/draft.gguf does not exist"),
    ],
)
def test_cli_speculative_errors_are_one_line(smollm2_gguf, capsys, argv, message):
    from genfast.cli import main

    assert main(["generate", "hi", *argv, "--model", str(smollm2_gguf), "--no-compile", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("genfast: error:") == 1 and "Traceback" not in err
    if "draft" in message:  # named before the target model's slow load
        assert "parameters" not in err


def test_cli_draft_flags_are_mutually_exclusive(capsys):
    from genfast.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "hi", "--prompt-lookup", "--self-draft", "int4"])
    assert "not allowed with" in capsys.readouterr().err


def test_bench_names_speculative_rows_and_prompts(smollm2_gguf):
    from genfast.llm.bench import LlmLadder, benchmark_prompt, draft_of
    from genfast.llm.checkpoints.checkpoint import Checkpoint
    from genfast.llm.checkpoints.tokenizer import load_tokenizer

    assert draft_of("spec-layers:24") == "layers:24" and draft_of("int4") is None
    with pytest.raises(UserError, match="unknown draft"):
        draft_of("spec-int3")
    ladder = LlmLadder()
    assert ladder.steps("spec-int4,int4,baseline") == ["baseline", "int4", "spec-int4"]
    assert ladder.steps("speculative") == ["compile", "spec-int4", "spec-int8", "spec-layers:24", "spec-prompt-lookup"]
    tok = load_tokenizer(Checkpoint.open(smollm2_gguf))
    code = benchmark_prompt(tok, 128, "code")
    assert len(code) == 128 and tok.decode(code).startswith('__all__ = ["rgb_to_yiq"')
    assert tok.decode(benchmark_prompt(tok, 64, "chat")).rstrip().endswith("assistant")
