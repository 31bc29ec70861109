"""`--model random:SHAPE`: published architectures with random weights, for speed measurements."""

from __future__ import annotations

import pytest
import torch

from genfast.errors import UserError
from genfast.llm.checkpoints import random_model
from genfast.llm.loading import load
from genfast.llm.model.transformer import parameter_counts
from tests.llm.hf_fixtures import TINY_CONFIGS

# Published parameter counts (their model cards), within 1%.
PUBLISHED = {
    "llama-2-7b": 6.74e9,
    "llama-2-70b": 68.98e9,
    "llama-3.1-8b": 8.03e9,
    "llama-3.2-1b": 1.24e9,
    "tinyllama-1.1b": 1.10e9,
    "smollm2-135m": 0.135e9,
}


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(random_model.SHAPES, "tiny", dict(TINY_CONFIGS["llama3"], vocab_size=10000))
    return "random:tiny"


@pytest.mark.parametrize("name", sorted(random_model.SHAPES))
def test_shapes_have_their_published_sizes_and_room_for_the_tokenizer(name):
    from genfast.llm.checkpoints.tokenizer import pydoc_tokenizer

    args = random_model.random_args(f"random:{name}")
    assert parameter_counts(args)[0] == pytest.approx(PUBLISHED[name], rel=0.01)
    assert pydoc_tokenizer().vocab_size <= args.vocab_size


def test_the_same_shape_loads_the_same_weights_with_unit_norms(tiny_shape):
    a, b = load(tiny_shape, "cpu", "float32"), load(tiny_shape, "cpu", "float32")
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), name
    weights = dict(a.model.named_parameters())
    assert torch.equal(weights["norm.weight"], torch.ones_like(weights["norm.weight"]))
    wqkv = weights["layers.0.attention.wqkv.weight"]
    assert 0.015 < wqkv.std().item() < 0.025 and not torch.equal(wqkv, weights["layers.1.attention.wqkv.weight"])


def test_text_encodes_within_the_vocabulary_and_generation_runs_to_its_length(tiny_shape):
    from genfast.llm.decoding.generate import Generator

    loaded = load(tiny_shape, "cpu", "float32", quant="int4")
    ids = loaded.tokenizer.encode("def main():\n    return 'the pydoc topics train this tokenizer'")
    assert 5 < len(ids) < 40 and max(ids) < 10000
    result = Generator(loaded.model, loaded.tokenizer, max_seq_len=128, compile=False).generate([ids], 12)
    assert len(result.token_ids[0]) == 12 and result.stop_reasons == ["length"]


def test_unknown_shapes_are_refused_with_the_known_ones():
    with pytest.raises(UserError, match="llama-2-7b"):
        load("random:llama-9", "cpu", "float32")
