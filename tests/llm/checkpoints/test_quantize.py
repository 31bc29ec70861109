"""Quantized LLMs: GGUF blocks loaded as they are, `genfast quantize` output directories, --quant."""

import stat

import pytest
import torch

from genfast.cli import main
from genfast.errors import UserError
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.weights import gguf_quantized_linears, load_model
from genfast.llm.loading import load
from genfast.quant.linear import QuantLinear
from tests.llm.gguf_fixtures import write_gguf_from_hf
from tests.llm.hf_fixtures import make_hf_model, save_hf_model, word_tokenizer


@pytest.mark.parametrize("name,arch", [("qwen2", "qwen2"), ("llama3", "llama")])  # llama: permuted q/k rows
@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_gguf_blocks_load_without_requantization(name, arch, qtype, bits, tmp_path):
    """The codes taken straight from Q8_0/Q4_0/Q4_1 blocks dequantize to exactly the weights the
    float loader gets from the same file (up to fp32 rounding of the two formulas)."""
    checkpoint = Checkpoint.open(write_gguf_from_hf(make_hf_model(name), tmp_path / "m.gguf", arch=arch, qtype=qtype))
    direct = gguf_quantized_linears(checkpoint, bits)
    model = load_model(checkpoint)
    layers = {
        f"layers.{i}.{m}"
        for i in range(2)
        for m in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
    }
    head = {"output"} if name == "llama3" else set()  # the fixture keeps a tied embedding in F32
    assert set(direct) == layers | head
    for module_name, qw in direct.items():
        assert qw.group_size == 32 and qw.bits == bits
        want = model.get_submodule(module_name).weight
        torch.testing.assert_close(qw.dequantize(), want, atol=1e-6 * want.abs().max().item(), rtol=0)
    assert gguf_quantized_linears(checkpoint, 12 - bits) == {}  # int8 wanted, int4 blocks found (or vice versa)


def test_quant_on_load_uses_gguf_blocks_unless_the_group_size_differs(tmp_path):
    path = write_gguf_from_hf(make_hf_model("qwen2"), tmp_path / "m.gguf", arch="qwen2", qtype="Q4_1")
    direct = gguf_quantized_linears(Checkpoint.open(path), 4)["layers.0.feed_forward.w2"]
    loaded = load(str(path), "cpu", "float32", quant="int4")
    w2 = loaded.model.layers[0].feed_forward.w2
    assert isinstance(w2, QuantLinear) and torch.equal(w2.quantized_weight().codes, direct.codes)
    assert loaded.quant == "int4-g32+int8"  # int4 linears, int8 head
    regrouped = load(str(path), "cpu", "float32", quant="int4", group_size=64).model.layers[0].feed_forward.w2
    assert regrouped.group_size == 64


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A tiny random Qwen2 (q/k/v biases, tied head) with a word-level tokenizer, on disk."""
    directory = save_hf_model(make_hf_model("qwen2"), tmp_path / "tiny")
    tokenizer = word_tokenizer(256)
    tokenizer.stop_ids = {3}
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    tokenizer.save(directory)
    return directory


PROMPT = "w5 w17 w3 w200 w9 w31 w64 w8"


def greedy(model_spec: str, **load_args) -> list[int]:
    from genfast.llm.decoding.generate import Generator
    from genfast.llm.decoding.sampling import SamplingParams

    loaded = load(model_spec, "cpu", "float32", **load_args)
    generator = Generator(loaded.model, loaded.tokenizer, max_seq_len=64, compile=False)
    ids = loaded.tokenizer.encode(PROMPT)
    return generator.generate([ids], 16, SamplingParams(), stop_at_eos=False).token_ids[0]


@pytest.mark.parametrize("mode,flags,scheme", [("int8", [], "int8"), ("int4", ["--group-size", "64"], "int4-g64+int8")])
def test_quantize_writes_a_directory_that_loads_to_the_same_model(
    mode, flags, scheme, tiny_model_dir, tmp_path, capsys, umask_022
):
    out = tmp_path / "q"
    assert (
        main(["quantize", "-m", str(tiny_model_dir), "--mode", mode, "-o", str(out), "--dtype", "float32", *flags]) == 0
    )
    assert f"({scheme}," in capsys.readouterr().out
    # As plain files and folders would be, not mkdtemp's 0700 or safetensors' 0600.
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [out, *out.iterdir()]}
    assert modes == {"q": 0o755, **{p.name: 0o644 for p in out.iterdir()}}
    loaded = load(str(out), "cpu", "float32")
    assert loaded.quant == scheme
    assert loaded.tokenizer.encode(PROMPT) == word_tokenizer(256).encode(PROMPT)
    assert loaded.tokenizer.stop_ids == {3} and loaded.tokenizer.chat_template.startswith("{% for")
    group = None if mode == "int8" else 64
    on_the_fly = greedy(str(tiny_model_dir), quant=mode, group_size=group)
    assert greedy(str(out)) == on_the_fly


def test_quantize_protects_existing_directories(tiny_model_dir, tmp_path, capsys):
    base = ["quantize", "-m", str(tiny_model_dir), "--mode", "int8"]
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep me")
    assert main([*base, "-o", str(user_dir)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main([*base, "-o", str(user_dir), "--force"]) == 2
    assert "not a `genfast quantize` output" in capsys.readouterr().err
    assert (user_dir / "notes.txt").read_text() == "keep me"

    out = tmp_path / "q"
    assert main([*base, "-o", str(out)]) == 0
    assert main([*base, "-o", str(out)]) == 2
    assert main([*base[:-1], "int4", "-o", str(out), "--force"]) == 0  # replaces an earlier output
    assert load(str(out), "cpu", "float32").quant == "int4-g32+int8"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--mode", "int4", "--group-size", "48"], "group-size for int4 must be one of"),
        (["--mode", "int8", "--group-size", "40"], "multiple of 32"),
        (["--mode", "int8", "--calibration", "x.txt"], "only applies to --mode int4-gptq"),
        (["--mode", "int4-gptq", "--calibration", "/nonexistent.txt"], "calibration file not found"),
    ],
)
def test_quantize_bad_flags(argv, message, tiny_model_dir, tmp_path, capsys):
    assert main(["quantize", "-m", str(tiny_model_dir), "-o", str(tmp_path / "q"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "genfast: quantizing" not in err  # before the model is read
    assert not (tmp_path / "q").exists()


def test_quantized_checkpoint_refuses_quant_again(tiny_model_dir, tmp_path):
    out = tmp_path / "q"
    assert main(["quantize", "-m", str(tiny_model_dir), "--mode", "int8", "-o", str(out)]) == 0
    with pytest.raises(UserError, match="already quantized"):
        load(str(out), "cpu", "float32", quant="int4")
    with pytest.raises(UserError, match="--group-size needs --quant"):
        load(str(tiny_model_dir), "cpu", "float32", group_size=32)


def test_quantize_gptq_writes_a_calibrated_int4_directory(tiny_model_dir, tmp_path, capsys):
    from genfast.quant.checkpoint import QuantizedCheckpoint

    rng = torch.Generator().manual_seed(0)
    text = " ".join(f"w{i}" for i in torch.randint(4, 256, (400,), generator=rng).tolist())
    (tmp_path / "calib.txt").write_text(text)
    out = tmp_path / "q"
    argv = [
        "quantize",
        "-m",
        str(tiny_model_dir),
        "--mode",
        "int4-gptq",
        "--group-size",
        "32",
        "-o",
        str(out),
        "--calibration",
        str(tmp_path / "calib.txt"),
        "--calibration-windows",
        "4",
        "--calibration-window",
        "64",
    ]
    assert main(argv) == 0
    assert "int4-g32" in capsys.readouterr().out
    header = QuantizedCheckpoint(out / "model.safetensors").metadata
    assert header["mode"] == "int4-gptq" and header["calibration"].endswith("4 windows x 64 tokens")
    loaded = load(str(out), "cpu", "float32")
    assert all(isinstance(m, QuantLinear) for m in (loaded.model.output, loaded.model.layers[1].feed_forward.w2))
    assert len(greedy(str(out))) == 16


def test_int4_keeps_the_output_head_in_int8(tmp_path):
    """The head is the most quantization-sensitive layer: int4 models keep it at 8 bits."""

    directory = save_hf_model(make_hf_model("llama3"), tmp_path / "m")
    word_tokenizer(320).save(directory)
    model = load(str(directory), "cpu", "float32", quant="int4", group_size=64).model
    assert model.output.bits == 8 and model.layers[0].attention.wqkv.bits == 4


@pytest.mark.parametrize("fmt,quant,group", [("hf", "int8", None), ("hf", "int4", 64), ("gguf", "int4", None)])
def test_quantizing_while_loading_equals_quantizing_the_loaded_model(fmt, quant, group, tmp_path):
    """`load --quant` quantizes each block as it is read (the float model never exists whole):
    the result is the model quantized after a whole load, tensor for tensor (GGUF: its own Q4_1
    blocks, taken as they are in both)."""
    from genfast.llm.checkpoints.quantize import quantize_loaded

    hf = make_hf_model("qwen2")
    if fmt == "hf":
        path = save_hf_model(hf, tmp_path / "m")
        word_tokenizer(hf.config.vocab_size).save(path)
    else:
        path = write_gguf_from_hf(hf, tmp_path / "m.gguf", arch="qwen2", qtype="Q4_1")
    checkpoint = Checkpoint.open(path)
    whole = load_model(checkpoint)
    quantize_loaded(checkpoint, whole, 8 if quant == "int8" else 4, group)
    streamed = load(str(path), "cpu", "float32", quant=quant, group_size=group).model
    want, got = whole.state_dict(), streamed.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_blocks_are_read_one_at_a_time(monkeypatch, tmp_path):
    """With a `prepare_block` hook, a block is allocated only after the one before it has been
    prepared: at most one block exists at full size."""
    from genfast.llm.model.layers import TransformerBlock

    path = save_hf_model(make_hf_model("llama3"), tmp_path / "m")
    allocated, prepared = [], []
    to_empty = TransformerBlock.to_empty

    def counting_to_empty(self, **kwargs):
        allocated.append(self)
        return to_empty(self, **kwargs)

    def prepare(prefix: str, block: TransformerBlock) -> None:
        assert allocated[-1] is block and len(allocated) == len(prepared) + 1, "a block was allocated ahead"
        prepared.append(prefix)

    monkeypatch.setattr(TransformerBlock, "to_empty", counting_to_empty)
    model = load_model(Checkpoint.open(path), prepare_block=prepare)
    assert prepared == ["layers.0.", "layers.1."] and len(model.layers) == 2


def test_an_int8_group_size_other_than_32_requantizes_the_gguf_head(tmp_path):
    """Only group 32 matches Q8_0's blocks: with --group-size 64 every int8 layer, the head too, is
    requantized (int4 keeps the head's Q8_0 codes whatever the group size: see INT4_HEAD_BITS)."""
    path = write_gguf_from_hf(make_hf_model("llama3"), tmp_path / "m.gguf", arch="llama", qtype="Q8_0")
    model = load(str(path), "cpu", "float32", quant="int8", group_size=64).model
    assert model.output.group_size == 64 and model.layers[0].attention.wqkv.group_size == 64
    assert load(str(path), "cpu", "float32", quant="int8").model.output.group_size == 32
