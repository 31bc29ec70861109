"""genfast.LLM: many prompts through the continuous-batching engine give what one-prompt
generation gives, in input order; chat through the template; bad input refused before anything
runs; pickling rebuilds it; Ray Data's batch protocol."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import genfast
from genfast.errors import UserError
from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.sampling import SamplingParams
from genfast.serve.offline import LLM, Completion
from tests.llm.hf_fixtures import save_tiny_chat_model

CONTEXT = 256
PROMPTS = ["w5 w17 w3", "w9 w9 w9 w9", "w200 w1 w33 w7", "w44 w45", "w300 w2 w8 w1 w9", "w12 w13", "w7"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-api"), CONTEXT)


@pytest.fixture(scope="module")
def llm(model_dir):
    # Two slots for seven prompts: requests join as others leave, and some wait for the window.
    with LLM(str(model_dir), compile=False, dtype="float32", device="cpu", max_batch=2) as llm:
        yield llm


def one_at_a_time(llm: LLM, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    generator = Generator(llm.loaded.model, llm.tokenizer, max_seq_len=CONTEXT, compile=False)
    return [generator.generate([llm.tokenizer.encode(p)], max_new_tokens).token_ids[0] for p in prompts]


def test_a_list_of_prompts_matches_one_prompt_at_a_time_in_order(model_dir, llm):
    results = llm.generate(PROMPTS, max_new_tokens=6)
    assert all(isinstance(r, Completion) for r in results)
    with LLM(str(model_dir), compile=False, dtype="float32", device="cpu", max_batch=1) as alone:
        want = one_at_a_time(alone, PROMPTS, 6)
    assert [r.token_ids for r in results] == want
    for result, prompt in zip(results, PROMPTS, strict=True):
        assert result.text == llm.tokenizer.decode(result.token_ids)
        assert result.finish_reason == "length"
        assert result.usage.prompt_tokens == len(prompt.split())
        assert result.usage.completion_tokens == 6
        assert result.usage.total_tokens == len(prompt.split()) + 6


def test_one_prompt_text_or_ids(llm):
    [by_text] = llm.generate("w5 w17 w3", max_new_tokens=4)
    [by_ids] = llm.generate([5, 17, 3], max_new_tokens=4)
    assert by_text.token_ids == by_ids.token_ids
    assert llm.generate([], max_new_tokens=4) == []


def test_chat_goes_through_the_template(llm):
    conversation = [{"role": "user", "content": "w5 w6"}]
    [reply] = llm.chat(conversation, max_new_tokens=5)
    [plain] = llm.generate("user w5 w6", max_new_tokens=5)
    assert reply.token_ids == plain.token_ids
    assert [r.token_ids for r in llm.chat([conversation, conversation], max_new_tokens=5)] == [plain.token_ids] * 2


def test_sampling_keywords_or_params_and_seeds_repeat(llm):
    a = llm.generate(PROMPTS[:3], temperature=1.0, top_k=20, seed=7, max_new_tokens=8)
    b = llm.generate(PROMPTS[:3], SamplingParams(temperature=1.0, top_k=20), seed=7, max_new_tokens=8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    with pytest.raises(UserError, match="either a SamplingParams or temperature"):
        llm.generate("w1", SamplingParams(), temperature=0.5)


def test_a_bad_prompt_is_refused_by_its_index_before_anything_runs(llm):
    steps = llm.engine.decode_steps
    with pytest.raises(UserError, match=r"prompt 1: this model's context holds 256 tokens"):
        llm.generate(["w1 w2", "w3 " * 250], max_new_tokens=10)
    with pytest.raises(UserError, match="prompt 0: the prompt is empty"):
        llm.generate([[]], max_new_tokens=3)
    assert llm.engine.decode_steps == steps


def test_pickles_as_its_arguments_and_is_rebuilt(llm):
    copy = pickle.loads(pickle.dumps(llm))
    try:
        assert copy is not llm and copy.engine is not llm.engine
        assert [r.token_ids for r in copy.generate(PROMPTS[:2], max_new_tokens=4)] == [
            r.token_ids for r in llm.generate(PROMPTS[:2], max_new_tokens=4)
        ]
    finally:
        copy.close()


def test_ray_data_batch_protocol_row_by_row(llm):
    conversation = [{"role": "user", "content": "w5 w6"}]
    batch = {
        "id": np.array([3, 4, 5, 6, 7]),
        "prompt": np.array([PROMPTS[0], PROMPTS[1], None, None, "w3 " * 260], dtype=object),
        "messages": np.array([None, None, conversation, None, None], dtype=object),
        "max_new_tokens": np.array([5, 3, 4, 5, 5]),
        "temperature": np.array([np.nan, 0.0, np.nan, np.nan, np.nan]),  # Arrow's missing floats
    }
    out = llm(batch)
    assert list(out["id"]) == [3, 4, 5, 6, 7]  # other columns pass through
    assert out["text"][0] == llm.generate(PROMPTS[0], max_new_tokens=5)[0].text
    assert out["text"][1] == llm.generate(PROMPTS[1], max_new_tokens=3)[0].text
    assert out["text"][2] == llm.chat(conversation, max_new_tokens=4)[0].text
    assert list(out["completion_tokens"]) == [5, 3, 4, 0, 0]
    assert list(out["finish_reason"]) == ["length", "length", "length", "error", "error"]
    assert out["error"][:3].tolist() == [None, None, None]
    assert 'give exactly one of "prompt"' in out["error"][3]
    assert "context holds 256 tokens" in out["error"][4]


def test_importable_from_the_package():
    assert genfast.LLM is LLM
