"""Streaming detokenization: the pieces add up to the full decode; stop strings cut exactly."""

import pytest

from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.tokenizer import load_tokenizer
from genfast.llm.decoding.streaming import TextStream

TEXT = "Hello, wörld! 東京 🤖🤖 naïve\n\tdef f(x):\n    return x**2  # done ✓"


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return load_tokenizer(Checkpoint.open(smollm2_gguf))


def stream(tokenizer, ids, stops=()):
    s = TextStream(tokenizer, tuple(stops))
    pieces = [s.push(i) for i in ids]
    pieces.append(s.finish())
    return s, pieces


def test_pieces_add_up_to_the_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    s, pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == s.text
    assert sum(1 for p in pieces if p) > len(ids) // 3  # it really streams
    assert all("\ufffd" not in p for p in pieces)  # no half characters (the emoji span tokens)


@pytest.mark.parametrize("stop", ["東京", "return", "✓", "x**2  #"])
def test_stop_string_cuts_before_it_and_never_leaks(tokenizer, stop):
    ids = tokenizer.encode(TEXT)
    s, pieces = stream(tokenizer, ids, [stop])
    assert s.stopped
    assert "".join(pieces) == s.text == TEXT[: TEXT.find(stop)]


def test_sentencepiece_leading_space_survives_windows(tmp_path):
    from genfast.llm.checkpoints.gguf_file import GGUFFile
    from genfast.llm.checkpoints.tokenizer import gguf_tokenizer
    from tests.llm.checkpoints.test_tokenizer import _write_spm_gguf

    tok = gguf_tokenizer(GGUFFile(_write_spm_gguf(tmp_path / "spm.gguf")).metadata)
    ids = tok.encode("hello world the cat")
    _, pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == "hello world the cat"
