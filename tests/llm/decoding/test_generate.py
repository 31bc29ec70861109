"""Generation: greedy equals transformers, batching, stopping, streaming, sampling, compile."""

import pytest
import torch

from genfast.errors import UserError
from genfast.kernels.qlinear import ops as kernels
from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.sampling import SamplingParams
from tests.llm.hf_fixtures import tiny_genfast_model, word_tokenizer


@pytest.fixture
def tiny(tmp_path):
    hf, model = tiny_genfast_model("llama3", tmp_path)
    return hf, model, word_tokenizer(hf.config.vocab_size)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers_generate(tiny):
    hf, model, tok = tiny
    prompt = torch.randint(0, 320, (11,)).tolist()
    result = Generator(model, tok, max_seq_len=64, compile=False).generate([prompt], 24, stop_at_eos=False)
    assert result.token_ids[0] == hf_greedy(hf, prompt, 24)


def test_batch_of_different_lengths_equals_one_by_one(tiny):
    _, model, tok = tiny
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (3, 12, 7)]
    batched = Generator(model, tok, max_seq_len=64, max_batch_size=3, compile=False).generate(prompts, 10)
    single = Generator(model, tok, max_seq_len=64, compile=False)
    for i, prompt in enumerate(prompts):
        assert batched.token_ids[i] == single.generate([prompt], 10).token_ids[0]


def test_eos_stops_and_is_not_emitted(tiny):
    _, model, tok = tiny
    gen = Generator(model, tok, max_seq_len=64, compile=False)
    prompt = [5, 6, 7]
    free = gen.generate([prompt], 12).token_ids[0]
    tok.stop_ids = {free[4]}
    stopped = gen.generate([prompt], 12)
    first = free.index(free[4])
    assert stopped.token_ids[0] == free[:first]
    assert stopped.stop_reasons == ["eos"]
    assert gen.generate([prompt], 12, stop_at_eos=False).token_ids[0] == free


def test_stop_string_truncates_text_and_streaming_matches(tiny):
    _, model, tok = tiny
    gen = Generator(model, tok, max_seq_len=64, compile=False)
    free = gen.generate([[1, 2, 3]], 12)
    words = free.texts[0].split(" ")
    stop = " ".join(words[5:7])
    chunks: list[str] = []
    result = gen.generate([[1, 2, 3]], 12, stop_strings=[stop], on_text=lambda i, t: chunks.append(t))
    assert result.stop_reasons == ["stop"]
    assert result.texts[0] == free.texts[0][: free.texts[0].find(stop)]
    assert "".join(chunks) == result.texts[0]
    assert stop not in "".join(chunks)


def test_prompt_longer_than_context_is_a_clear_error(tiny):
    _, model, tok = tiny
    gen = Generator(model, tok, max_seq_len=16, compile=False)
    with pytest.raises(UserError, match=r"context holds 16 \(model limit \d+\); pass --max-seq-len 20 \(or more\)"):
        gen.generate([list(range(12))], 8)
    with pytest.raises(UserError, match=r"holds 16 \(model limit (\d+)\); shorten the prompt"):
        gen.generate([list(range(12))], model.args.max_seq_len)  # more than the model holds: no flag helps
    with pytest.raises(UserError, match="empty"):
        gen.generate([[]], 8)


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny):
    _, model, tok = tiny
    gen = Generator(model, tok, max_seq_len=64, compile=False)
    prompt = [9, 8, 7]
    greedy = gen.generate([prompt], 16).token_ids[0]
    hot = SamplingParams(temperature=1.5)
    a = gen.generate([prompt], 16, hot, seed=1).token_ids[0]
    assert a == gen.generate([prompt], 16, hot, seed=1).token_ids[0]
    assert a != gen.generate([prompt], 16, hot, seed=2).token_ids[0]
    assert gen.generate([prompt], 16, SamplingParams(1.0, top_k=1), seed=3).token_ids[0] == greedy
    assert gen.generate([prompt], 16, SamplingParams(1.0, top_p=1e-6), seed=3).token_ids[0] == greedy


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=0), dict(top_p=0), dict(top_p=1.5)])
def test_bad_sampling_values_are_clear_errors(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad)


def check_compiled_matches_eager(model, tok) -> Generator:
    """Compiled prefill/decode (left-padded batch) give eager's tokens; new prompt and cache lengths
    reuse the graphs. Returns the compiled generator."""
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12]]
    eager = Generator(model, tok, max_seq_len=64, max_batch_size=2, compile=False).generate(prompts, 12)
    compiled = Generator(model, tok, max_seq_len=64, max_batch_size=2, compile=True)
    compiled.warmup()
    assert compiled.generate(prompts, 12).token_ids == eager.token_ids

    from torch._dynamo.utils import counters

    frames = dict(counters["frames"])
    other = [[7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4]]
    want = Generator(model, tok, max_seq_len=64, max_batch_size=2, compile=False).generate(other, 20)
    assert compiled.generate(other, 20).token_ids == want.token_ids
    assert dict(counters["frames"]) == frames, "a new prompt or cache length recompiled"
    assert compiled.guard_fallbacks == 0  # steady decode steps really skipped guard evaluation
    return compiled


def test_compiled_matches_eager_without_recompiling(tmp_path):
    hf, model = tiny_genfast_model("qwen2", tmp_path)
    tok = word_tokenizer(hf.config.vocab_size)
    compiled = check_compiled_matches_eager(model, tok)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12]]
    eager = Generator(model, tok, max_seq_len=64, max_batch_size=2, compile=False).generate(prompts, 12)
    # A different sampling mode needs a new decode graph: its first step compiles it with all
    # guards, and the steady steps after it must use that graph, not the greedy one.
    hot = SamplingParams(temperature=0.7, top_k=5)
    sampled = compiled.generate(prompts, 12, hot, seed=4).token_ids
    guarded = Generator(model, tok, max_seq_len=64, max_batch_size=2, compile=True)
    guarded.skip_guards = False
    assert guarded.generate(prompts, 12, hot, seed=4).token_ids == sampled
    assert sampled != eager.token_ids
    assert compiled.guard_fallbacks == 0


def test_steady_decode_falls_back_to_full_guards(tiny):
    """If dynamo would need to recompile under the guard-skipping stance, the step is retried."""
    _, model, tok = tiny
    gen = Generator(model, tok, max_seq_len=64, compile=False)
    gen.compiled = True  # drive _step's compiled branch with stand-in callables
    calls = []

    def fake_decode(*args):
        calls.append(torch.compiler.is_compiling())
        if len(calls) == 1:
            raise RuntimeError("Recompilation triggered with skip_guard_eval_unsafe stance.")
        return torch.tensor([1])

    gen._decode = fake_decode
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    out = gen._step(torch.tensor([[1]]), torch.tensor([4]), mask, SamplingParams(), steady=True)
    assert out.tolist() == [1] and len(calls) == 2 and gen.guard_fallbacks == 1


def test_cuda_steps_replay_cuda_graphs_for_decode_only_and_tune_decode_only():
    from genfast.compilation.inductor import inductor_options

    decode, prefill = inductor_options("cuda", decode=True), inductor_options("cuda", decode=False)
    assert decode["triton.cudagraphs"] and decode["coordinate_descent_tuning"]
    assert not prefill["triton.cudagraphs"] and not prefill["coordinate_descent_tuning"]
    assert not inductor_options("cuda", decode=True, cuda_graphs=False)["triton.cudagraphs"]
    assert "max_autotune" not in prefill and inductor_options("cuda", decode=False, max_autotune=True)["max_autotune"]
    assert "max_autotune" not in inductor_options("cpu", decode=False, max_autotune=True)  # measured no help there


@pytest.mark.skipif(not kernels.available(), reason="no native quantized kernel on this machine")
def test_compiled_native_quantized_decode_uses_the_cpp_wrapper_and_matches_eager(tmp_path):
    """Decode of a model on genfast's native int4/int8 kernels compiles with inductor's C++
    wrapper (measured faster there, docs/performance.md); it must give eager's tokens."""
    from genfast.compilation.inductor import inductor_options
    from genfast.quant.linear import quantize_linears, uses_native_kernels

    hf, model = tiny_genfast_model("qwen2", tmp_path)
    quantize_linears(model, 4, 32)
    assert uses_native_kernels(model)
    assert inductor_options("cpu", decode=True, native_kernels=True).get("cpp_wrapper")
    assert not inductor_options("cpu", decode=False, native_kernels=True).get("cpp_wrapper")
    assert not inductor_options("cpu", decode=True).get("cpp_wrapper")
    # Decode drops inductor's per-call input size asserts (genfast builds the inputs), prefill keeps them.
    assert inductor_options("cpu", decode=True)["size_asserts"] is False
    assert "size_asserts" not in inductor_options("cpu", decode=False)
    tok = word_tokenizer(hf.config.vocab_size)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12]]
    eager = Generator(model, tok, max_seq_len=64, max_batch_size=2, compile=False).generate(prompts, 12)
    compiled = Generator(model, tok, max_seq_len=64, max_batch_size=2, compile=True)
    assert compiled.generate(prompts, 12).token_ids == eager.token_ids
    assert compiled.guard_fallbacks == 0


@pytest.mark.parametrize("name,compile", [("qwen2", True), ("gemma2", False)])  # gemma2: rings across turns
def test_a_conversation_reuses_the_cache_of_its_earlier_turns(name, compile, tmp_path):
    """With reuse_prefix (genfast chat), a prompt that continues the previous generation prefills
    only its new tokens, and one that diverges reuses the common prefix; the tokens equal a
    fresh generator's (fp32)."""
    from genfast.llm.checkpoints.checkpoint import Checkpoint
    from genfast.llm.checkpoints.weights import load_model

    hf, model = tiny_genfast_model(name, tmp_path)
    tok = word_tokenizer(hf.config.vocab_size)
    chat = Generator(model, tok, max_seq_len=96, compile=compile)
    chat.reuse_prefix = True
    fresh = Generator(load_model(Checkpoint.open(tmp_path / f"{name}-0")), tok, max_seq_len=96, compile=False)

    def turn(prompt: list[int], cached: int) -> list[int]:
        got = chat.generate([prompt], 10, stop_at_eos=False)
        assert got.cached_prompt_tokens == cached
        assert got.token_ids == fresh.generate([prompt], 10, stop_at_eos=False).token_ids
        return got.token_ids[0]

    first = list(range(3, 33))
    reply = turn(first, cached=0)
    second = first + reply + [40, 41, 42, 43, 44]
    turn(second, cached=len(first) + 9)  # the reply's last token was never fed back
    # Diverging after 12 tokens goes back over 41 cached positions: beyond what a ring of the
    # window + 32 slots keeps, so Gemma 2 prefills it all.
    turn(second[:12] + [50, 51, 52], cached=0 if name == "gemma2" else 12)
    turn(second[:12] + [50, 51, 52], cached=14)  # the same prompt again: all but its last token
