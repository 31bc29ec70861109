"""Checkpoint (genfast/llm/checkpoints/checkpoint.py): a checkpoint's format is detected once and
its files opened once, however many readers it has (config, weights, tokenizer, quantization on
load); a path that is no checkpoint is the same one-line error as before."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from genfast.cli import main
from genfast.errors import UserError
from genfast.llm.checkpoints import checkpoint as checkpoint_module
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.random_model import random_args
from genfast.llm.checkpoints.tokenizer import load_tokenizer, pydoc_tokenizer
from genfast.llm.loading import load
from genfast.llm.model.config import ModelArgs
from tests.llm.gguf_fixtures import write_gguf_from_hf
from tests.llm.hf_fixtures import make_hf_model, save_hf_model, word_tokenizer


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    """A tiny Llama in Q4_1 blocks (the int4 grid: quantization on load takes them as they are)."""
    return write_gguf_from_hf(make_hf_model("llama3"), tmp_path / "m.gguf", arch="llama", qtype="Q4_1")


def calls(monkeypatch, name: str) -> list[tuple]:
    """The calls made from now on to checkpoint.py's `name` (which still runs)."""
    made: list[tuple] = []
    function = getattr(checkpoint_module, name)

    def counting(*args):
        made.append(args)
        return function(*args)

    monkeypatch.setattr(checkpoint_module, name, counting)
    return made


def test_each_format_is_detected(tiny_gguf, tmp_path):
    hf = save_hf_model(make_hf_model("smollm"), tmp_path / "hf")
    assert Checkpoint.open(hf).format == "hf"
    assert Checkpoint.open(str(tiny_gguf)).format == "gguf"
    holder = tiny_gguf.parent  # a directory holding exactly one GGUF file
    assert Checkpoint.open(holder).format == "gguf" and Checkpoint.open(holder).gguf_path == tiny_gguf
    random = Checkpoint.open("random:smollm2-135m")
    assert random.format == "random" and random.args == random_args("random:smollm2-135m")
    assert load_tokenizer(random) is pydoc_tokenizer()


NOT_A_CHECKPOINT = {
    "missing": "model not found: {} does not exist",
    "text file": "{} is neither a GGUF file nor a Hugging Face model directory",
    "empty directory": "{} holds neither a config.json (Hugging Face model) nor exactly one .gguf file",
    "two GGUF files": "{} holds neither a config.json (Hugging Face model) nor exactly one .gguf file",
}


def _not_a_checkpoint(kind: str, directory: Path) -> Path:
    if kind == "missing":
        return directory / "missing.gguf"
    if kind == "text file":
        (directory / "notes.txt").write_text("hello")
        return directory / "notes.txt"
    if kind == "two GGUF files":
        for name in ("a.gguf", "b.gguf"):
            (directory / name).write_bytes(b"GGUF")
    return directory


@pytest.mark.parametrize("kind", NOT_A_CHECKPOINT)
def test_a_path_that_is_no_checkpoint_is_a_one_line_error(kind, tmp_path):
    path = _not_a_checkpoint(kind, tmp_path)
    with pytest.raises(UserError, match=f"^{re.escape(NOT_A_CHECKPOINT[kind].format(path))}$"):
        Checkpoint.open(path)


def test_an_unknown_random_shape_is_a_one_line_error():
    with pytest.raises(UserError, match=r"^unknown random-weight shape 'nope'; use random: with one of llama-2-7b, "):
        Checkpoint.open("random:nope")
    with pytest.raises(UserError, match="unknown random-weight shape 'nope'"):
        load("random:nope", "cpu", "float32")


def test_a_quantized_load_detects_the_format_once_and_opens_the_gguf_once(monkeypatch, tiny_gguf):
    detections, opens = calls(monkeypatch, "detect_format"), calls(monkeypatch, "open_gguf")
    loaded = load(str(tiny_gguf), "cpu", "float32", quant="int4")  # tokenizer, config, weights, each block's codes
    assert loaded.quant == "int4-g32+int8" and loaded.path == tiny_gguf
    assert len(detections) == 1 and len(opens) == 1
    draft = load(loaded.checkpoint, "cpu", "float32", quant="int8")  # as a self-draft loads its target again
    assert draft.checkpoint is loaded.checkpoint and len(detections) == 1 and len(opens) == 1


def test_genfast_quantize_and_its_output_read_each_checkpoint_once(monkeypatch, tiny_gguf, tmp_path):
    import genfast.quant.checkpoint

    detections, opens = calls(monkeypatch, "detect_format"), calls(monkeypatch, "open_gguf")
    out = tmp_path / "q"
    assert main(["quantize", "-m", str(tiny_gguf), "--mode", "int8", "-o", str(out), "--dtype", "float32"]) == 0
    assert len(detections) == 1 and len(opens) == 1

    headers = []
    real = genfast.quant.checkpoint.QuantizedCheckpoint

    def counting(path: Path) -> genfast.quant.checkpoint.QuantizedCheckpoint:
        headers.append(path)
        return real(path)

    monkeypatch.setattr(genfast.quant.checkpoint, "QuantizedCheckpoint", counting)
    detections.clear()
    loaded = load(str(out), "cpu", "float32")
    assert loaded.checkpoint.format == "genfast" and loaded.quant == "int8"
    assert len(detections) == 1 and len(headers) == 1
    assert loaded.model.args == Checkpoint.open(tiny_gguf).args


def test_hf_config_is_read_once(monkeypatch, tmp_path):
    directory = save_hf_model(make_hf_model("qwen2"), tmp_path / "hf")
    word_tokenizer(256).save(directory)
    reads = calls(monkeypatch, "read_json")
    loaded = load(str(directory), "cpu", "float32", quant="int8")
    assert [p.name for (p,) in reads] == ["config.json"]
    assert isinstance(loaded.checkpoint.args, ModelArgs) and loaded.model.args == loaded.checkpoint.args
