"""`genfast bench llm`'s prompts (genfast/llm/bench.py); the ladder itself runs in tests/test_cli.py."""

from __future__ import annotations

import pytest

from genfast.errors import UserError
from genfast.llm.bench import benchmark_prompt
from tests.llm.hf_fixtures import word_tokenizer


def test_a_prompt_longer_than_the_text_names_how_many_tokens_it_has():
    tokenizer = word_tokenizer(320)
    assert len(benchmark_prompt(tokenizer, 100, "code")) == 100
    with pytest.raises(UserError, match=r"--prompt-tokens 1000000 is more than the code text provides: \d+ tokens"):
        benchmark_prompt(tokenizer, 1_000_000, "code")
