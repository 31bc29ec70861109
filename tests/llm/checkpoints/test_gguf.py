"""GGUF loading: llama.cpp's layout (permuted q/k, quantized blocks) reproduces the source model."""

from pathlib import Path

import numpy as np
import pytest
import torch

from genfast.errors import UserError
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.tokenizer import load_tokenizer
from genfast.llm.checkpoints.weights import load_model
from tests.llm.gguf_fixtures import write_gguf_from_hf
from tests.llm.hf_fixtures import make_hf_model


@pytest.mark.parametrize("name,arch", [("smollm", "llama"), ("qwen2", "qwen2")])
def test_f32_gguf_reproduces_transformers_logits(name, arch, tmp_path):
    hf = make_hf_model(name)
    model = load_model(Checkpoint.open(write_gguf_from_hf(hf, tmp_path / "m.gguf", arch=arch)))
    tokens = torch.randint(0, hf.config.vocab_size, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens, torch.arange(20), all_logits=True), hf(tokens).logits, atol=1e-4, rtol=0
        )


@pytest.mark.parametrize(
    "qtype,max_rel_err", [("Q8_0", 0.01), ("Q4_0", 0.15), ("Q4_1", 0.15), ("F16", 1e-3), ("BF16", 1e-2)]
)
def test_quantized_gguf_dequantizes_close_to_source(qtype, max_rel_err, tmp_path):
    """Weights come back within the format's rounding error (relative Frobenius error)."""
    hf = make_hf_model("qwen2")  # no q/k permutation: compare tensors directly
    model = load_model(Checkpoint.open(write_gguf_from_hf(hf, tmp_path / f"{qtype}.gguf", arch="qwen2", qtype=qtype)))
    want = hf.model.layers[0].mlp.down_proj.weight
    got = model.layers[0].feed_forward.w2.weight
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < max_rel_err, rel
    assert rel > 0 or qtype in ("F16", "BF16")


def test_q4_k_blocks_dequantize_in_row_order(tmp_path):
    """A hand-built Q4_K tensor (d=1, dmin=0, every sub-block scale 1) holds its 4-bit values."""
    import gguf
    import numpy as np

    from genfast.llm.checkpoints.gguf_file import GGUFFile

    rows, cols = 3, 512
    values = np.random.default_rng(0).integers(0, 16, size=(rows, cols), dtype=np.uint8)
    blocks = []
    for block in values.reshape(-1, 256):
        header = np.array([1.0, 0.0], dtype=np.float16).view(np.uint8)  # d, dmin
        scales = np.array([1] * 4 + [0] * 4 + [1] * 4, dtype=np.uint8)  # 6-bit scales 1, mins 0
        chunks = block.reshape(4, 2, 32)  # per 64 values: 32 in low nibbles, 32 in high nibbles
        qs = (chunks[:, 0] | (chunks[:, 1] << 4)).reshape(-1)
        blocks.append(np.concatenate([header, scales, qs]))
    raw = np.stack(blocks).reshape(rows, -1)
    writer = gguf.GGUFWriter(str(tmp_path / "q4k.gguf"), "llama")
    writer.add_tensor("w", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = GGUFFile(tmp_path / "q4k.gguf").tensor("w")
    assert got.shape == (rows, cols)
    assert torch.equal(got, torch.from_numpy(values.astype(np.float32)))


def test_real_smollm2_logits_match_transformers(smollm2_gguf, smollm2_hf):
    hf_model, hf_tok = smollm2_hf
    model = load_model(Checkpoint.open(smollm2_gguf))
    ids = torch.tensor([hf_tok("The capital of France is Paris, and the capital of Italy is").input_ids])
    with torch.no_grad():
        want = hf_model(ids).logits
        got = model(ids, torch.arange(ids.shape[1]), all_logits=True)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)


def test_truncated_gguf_is_a_clear_error(tmp_path):
    path = write_gguf_from_hf(make_hf_model("smollm"), tmp_path / "cut.gguf", truncate_to=30_000)
    with pytest.raises(UserError, match=r"truncated|corrupt"):
        load_model(Checkpoint.open(path))


def test_garbage_after_magic_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 200)
    with pytest.raises(UserError, match="not a readable GGUF"):
        load_model(Checkpoint.open(path))


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    path = write_gguf_from_hf(make_hf_model("smollm"), tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(UserError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(Checkpoint.open(path))


def test_not_a_model_is_a_clear_error(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(UserError, match="neither a GGUF file nor a Hugging Face model directory"):
        load_model(Checkpoint.open(path))
    with pytest.raises(UserError, match="does not exist"):
        load_model(Checkpoint.open(tmp_path / "missing.gguf"))


def test_gguf_tokenizer_metadata(smollm2_gguf):
    tok = load_tokenizer(Checkpoint.open(smollm2_gguf))
    assert tok.bos_id == 1 and not tok.add_bos
    assert 2 in tok.stop_ids  # <|im_end|>
    assert "<|im_start|>" in tok.chat_template


def _reference_metadata(path):
    """The `gguf` package's own reader of the same file: the independent reference for the header."""
    from gguf import GGUFReader, GGUFValueType

    def value(field):
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
            return [field.parts[i].tolist()[0] for i in field.data]
        if kind == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        scalar = field.parts[field.data[0]].tolist()[0]
        return bool(scalar) if kind == GGUFValueType.BOOL else scalar

    reader = GGUFReader(path, "r")
    fields = {k: value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # its own counters
    return fields, {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_header_and_tensors_read_as_the_gguf_package_reads_them(qtype, tmp_path):
    from gguf.quants import dequantize

    from genfast.llm.checkpoints.gguf_file import GGUFFile

    path = write_gguf_from_hf(make_hf_model("qwen2"), tmp_path / f"{qtype}.gguf", arch="qwen2", qtype=qtype)
    want_meta, want_tensors = _reference_metadata(path)
    ours = GGUFFile(path)
    assert ours.metadata == want_meta and ours.tensor_names == set(want_tensors)
    for name, t in want_tensors.items():
        assert ours.tensor_type(name) == t.tensor_type.name
        want = torch.from_numpy(
            np.array(dequantize(t.data, t.tensor_type), np.float32).reshape(tuple(reversed(t.shape)))
        )
        torch.testing.assert_close(ours.tensor(name), want, atol=1e-6 * want.abs().max().item(), rtol=0)


def test_real_smollm2_header_reads_as_the_gguf_package_reads_it(smollm2_gguf):
    from genfast.llm.checkpoints.gguf_file import GGUFFile

    want_meta, want_tensors = _reference_metadata(smollm2_gguf)
    ours = GGUFFile(smollm2_gguf)
    assert ours.metadata == want_meta and len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert {n: ours.tensor_type(n) for n in ours.tensor_names} == {
        n: t.tensor_type.name for n, t in want_tensors.items()
    }


def _file_backed_rss() -> int:
    """Bytes of mapped files this process holds resident (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's RssFile")
@pytest.mark.parametrize("read", ["tensor", "raw_blocks", "quantized"])
def test_reading_a_tensor_leaves_none_of_the_file_resident(read, tmp_path):
    """Each tensor read copies its bytes out of the map and releases the pages it touched, so
    loading a large GGUF does not keep the file resident (gpt-oss-20b: 6.8 GiB before)."""
    import gguf

    from genfast.llm.checkpoints.gguf_file import GGUFFile

    rows, cols = 1024, 8192  # 32 MiB as F32, 8.5 MiB as Q8_0
    values = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "big.gguf"), "llama")
    for name in ("first", "w"):  # the first read also pages in the code it runs
        if read == "quantized":
            writer.add_tensor(name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(tmp_path / "big.gguf")
    getattr(file, read)("first")
    before = _file_backed_rss()
    got = getattr(file, read)("w")
    assert got is not None
    assert _file_backed_rss() - before < 2 * 2**20
    if read == "tensor":
        assert torch.equal(got, torch.from_numpy(values))
