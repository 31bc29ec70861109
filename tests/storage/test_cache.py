"""`genfast cache`: list, size and clear what lives under GENFAST_HOME; models stay unless named."""

from __future__ import annotations

import json
import os

from genfast.cli import main


def _home(tmp_path):
    home = tmp_path / "home"
    (home / "compiled" / "abc123").mkdir(parents=True)
    (home / "compiled" / "abc123" / "decode.aot").write_bytes(b"x" * 2000)
    description = {"what": "llm prefill and decode", "model_args": {"dim": 64, "n_layers": 2, "vocab_size": 300},
                   "dtype": "float32", "quant": "none", "batch": 1, "cache_len": 64,
                   "environment": {"torch": "2.13.0", "isa": "avx512"}}  # fmt: skip
    (home / "compiled" / "abc123" / "artifact.json").write_text(json.dumps(description))
    for part in ("inductor", "kernels", "models/m"):
        (home / part).mkdir(parents=True)
        (home / part / "f").write_bytes(b"y" * 1000)
    return home


def test_list_size_and_clear(tmp_path, monkeypatch, capsys):
    home = _home(tmp_path)
    monkeypatch.setenv("GENFAST_HOME", str(home))
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "GENFAST_KERNEL_DIR"):
        monkeypatch.delenv(variable, raising=False)
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "compiled steps (1)" in out and "abc123" in out and "dim 64, 2 layers" in out and "ISA avx512" in out
    assert main(["cache", "size"]) == 0
    out = capsys.readouterr().out
    assert "compiled     2.2 KB" in out and "models       1.0 KB" in out and "total" in out
    assert main(["cache", "clear"]) == 0
    assert not (home / "compiled").exists() and not (home / "inductor").exists() and not (home / "kernels").exists()
    assert (home / "models" / "m" / "f").exists()  # downloads are kept unless named
    assert main(["cache", "clear", "models"]) == 0
    assert not (home / "models").exists()
    assert "cleared models" in capsys.readouterr().out


def test_unknown_part_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GENFAST_HOME", str(tmp_path))
    assert main(["cache", "clear", "everything"]) == 2
    assert capsys.readouterr().err.startswith("genfast: error: unknown cache part everything")
    assert os.listdir(tmp_path) == []


def test_inductor_cache_is_kept_per_code_target_unless_the_user_chose_a_place(tmp_path, monkeypatch):
    """Inductor writes its default place into TORCHINDUCTOR_CACHE_DIR on first use (importing
    genfast.nn does): that counts as unchosen, or a benchmark script would share AVX-512 and
    AVX2-capped code in one folder (it crashed so)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from genfast.compilation.inductor import use_persistent_cache
    from genfast.platform import hardware

    monkeypatch.setenv("GENFAST_HOME", str(tmp_path))
    expected = str(tmp_path / "inductor" / hardware.code_target())
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    use_persistent_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == expected
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    use_persistent_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == expected
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    use_persistent_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
