"""Perplexity: equals transformers' loss on the same windows; `genfast eval ppl` writes its JSON."""

import json
import math

import pytest
import torch

from genfast.cli import main
from genfast.errors import UserError
from genfast.llm.perplexity import make_windows, perplexity
from tests.llm.hf_fixtures import save_hf_model, tiny_genfast_model


def hf_perplexity(hf, windows: torch.Tensor) -> float:
    """The reference: transformers' mean loss per window, weighted by scored tokens."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            loss = hf(w[None], labels=w[None]).loss.item()
            nll += loss * (len(w) - 1)
            count += len(w) - 1
    return math.exp(nll / count)


@pytest.mark.parametrize("name", ["llama3", "smollm"])
@pytest.mark.parametrize("bos", [None, 7])
def test_matches_transformers(name, bos, tmp_path):
    hf, model = tiny_genfast_model(name, tmp_path)
    ids = torch.randint(0, hf.config.vocab_size, (5 * 48 + 13,))  # 5 windows and a ragged tail
    # batch_size 2: two full batches and a last batch of one window.
    result = perplexity(model, ids, window=48, batch_size=2, bos_id=bos)
    windows = make_windows(ids, 48, bos_id=bos)
    assert result.windows == len(windows) == 5 and result.tokens == 5 * 47
    if bos is not None:
        assert (windows[:, 0] == bos).all() and windows[0, 1:].tolist() == ids[:47].tolist()
    assert result.ppl == pytest.approx(hf_perplexity(hf, windows), rel=1e-4)
    assert result.nll == pytest.approx(math.log(result.ppl))
    # Batching changes nothing but summation order; max_windows keeps the first windows.
    assert perplexity(model, ids, window=48, batch_size=5, bos_id=bos).ppl == pytest.approx(result.ppl, rel=1e-5)
    first = perplexity(model, ids, window=48, max_windows=2, bos_id=bos)
    assert first.windows == 2 and first.ppl == pytest.approx(hf_perplexity(hf, windows[:2]), rel=1e-4)


def test_kv_caches_are_restored(tmp_path):
    hf, model = tiny_genfast_model("smollm", tmp_path)
    model.setup_caches(2, 32)
    caches = [layer.attention.kv_cache for layer in model.layers]
    ids = torch.randint(0, hf.config.vocab_size, (100,))
    perplexity(model, ids, window=64)  # longer than the cache: runs without it
    assert [layer.attention.kv_cache for layer in model.layers] == caches
    assert (model.max_batch_size, model.max_seq_len) == (2, 32)


def test_window_longer_than_context_is_a_user_error(tmp_path):
    _, model = tiny_genfast_model("smollm", tmp_path)  # context 128
    with pytest.raises(UserError, match="longer than the model's context of 128"):
        perplexity(model, list(range(1000)), window=129)
    with pytest.raises(UserError, match="too few for one window"):
        perplexity(model, list(range(50)), window=64)
    with pytest.raises(UserError, match="at least 2"):
        perplexity(model, list(range(50)), window=1)


def byte_level_model_dir(tmp_path):
    """A tiny random model directory with a byte-level tokenizer (ids 0..255) that genfast loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tests.llm.hf_fixtures import make_hf_model

    directory = save_hf_model(make_hf_model("smollm"), tmp_path / "tiny")  # vocab 300
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(str(directory / "tokenizer.json"))
    return directory


def test_cli_writes_json_and_refuses_to_overwrite(tmp_path, capsys):
    directory = byte_level_model_dir(tmp_path)
    out = tmp_path / "out.json"
    argv = [
        "eval",
        "ppl",
        "--model",
        str(directory),
        "--window",
        "32",
        "--max-windows",
        "3",
        "--batch-size",
        "2",
        "--dtype",
        "float32",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {"ppl", "nll", "tokens", "windows", "window", "model", "quant", "dtype", "corpus"} <= data.keys()
    assert (data["windows"], data["window"], data["tokens"]) == (3, 32, 3 * 31)
    assert (data["model"], data["quant"], data["dtype"]) == ("tiny", "none", "float32")
    assert data["corpus"] == "pydoc_data.topics evaluation half"
    assert 1 < data["ppl"] < 1000 and data["ppl"] == pytest.approx(math.exp(data["nll"]))
    assert stdout.count("\n") == 1 and f"ppl {data['ppl']:.4f}" in stdout and "3 windows x 32" in stdout

    before = out.read_text()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("genfast: error:") and "--force" in err
    assert out.read_text() == before
    assert main(argv[:-4] + ["--max-windows", "1", "--json", str(out), "--force"]) == 0
    assert json.loads(out.read_text())["windows"] == 1


def test_cli_window_longer_than_context(tmp_path, capsys):
    directory = byte_level_model_dir(tmp_path)
    assert main(["eval", "ppl", "--model", str(directory), "--window", "512"]) == 2
    assert "context of 128" in capsys.readouterr().err


@pytest.mark.slow
def test_real_model_matches_transformers(smollm2_gguf, smollm2_hf):
    from genfast.llm.corpus import evaluation_text
    from genfast.llm.loading import load
    from genfast.llm.perplexity import evaluation_token_ids, window_bos

    loaded = load(str(smollm2_gguf), "cpu", "float32")
    ids = evaluation_token_ids(loaded.tokenizer)
    assert window_bos(loaded.tokenizer) is None  # SmolLM2 adds no BOS
    hf, hf_tokenizer = smollm2_hf
    window, n = 512, 3
    assert (
        ids[: window * n] == hf_tokenizer(evaluation_text()[:20000], add_special_tokens=False).input_ids[: window * n]
    )
    result = perplexity(loaded.model, ids, window=window, max_windows=n, batch_size=2)
    assert result.windows == n and result.tokens == n * (window - 1)
    assert result.ppl == pytest.approx(hf_perplexity(hf, make_windows(ids, window, n)), rel=1e-3)
