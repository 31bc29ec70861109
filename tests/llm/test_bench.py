"""`genfast bench llm`'s prompts and options (genfast/llm/bench.py); the ladder itself runs in tests/test_cli.py."""

from __future__ import annotations

import pytest

from genfast.bench.ladder import Row
from genfast.errors import UserError
from genfast.llm.bench import benchmark_prompt
from tests.llm.hf_fixtures import word_tokenizer


def test_a_prompt_longer_than_the_text_names_how_many_tokens_it_has():
    tokenizer = word_tokenizer(320)
    assert len(benchmark_prompt(tokenizer, 100, "code")) == 100
    with pytest.raises(UserError, match=r"--prompt-tokens 1000000 is more than the code text provides: \d+ tokens"):
        benchmark_prompt(tokenizer, 1_000_000, "code")


@pytest.mark.parametrize("step,want", [("int4", 128), ("int8", None), ("compile", None)])
def test_the_int4_group_size_reaches_the_int4_rows_only(monkeypatch, tmp_path, step, want):
    """`--int4-group-size 128` (the speed of fewer scale bytes against g32's accuracy) loads the int4
    rows in groups of 128 and leaves int8 per channel."""
    import torch

    import genfast.llm.loading
    from genfast.llm.bench import LlmLadder
    from genfast.recipe import Target

    class Loaded(Exception):
        pass

    def fake_load(model, device, dtype, threads, quant, group_size=None, tp=1, batch_invariant=None):
        raise Loaded(quant, group_size)

    monkeypatch.setattr(genfast.llm.loading, "load", fake_load)
    ladder = LlmLadder()
    options = {
        "model": "m",
        "device": "cpu",
        "threads": None,
        "tp": 1,
        "spec_target": "compile",
        "int4_group_size": 128,
    }
    target = Target(torch.device("cpu"), "auto")
    with pytest.raises(Loaded) as loaded:
        ladder.build(Row(step), ladder.recipe.plan(step, target), options, target, tmp_path)
    assert loaded.value.args[1] == want
    assert "int4 rows in groups of 128" in ladder.header({**options, "prompt": "pydoc", "prompt_tokens": 8,
                                                           "new_tokens": 8, "repeats": 1}, "this machine")  # fmt: skip
