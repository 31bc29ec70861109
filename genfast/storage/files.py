"""Files written whole or not at all: a reader never sees a half-written one; outputs checked
before the work that makes them."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from genfast.errors import UserError


def _umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def make_public(path: str | Path) -> None:
    """Give a file or directory that mkstemp, mkdtemp or safetensors made private (0600, 0700) the
    mode a plain open() or mkdir() would have given it (less the umask), before it is renamed into
    place: outputs and cached models are for whoever may read their folder, as other tools' are."""
    full = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, full & ~_umask())


def write_json_atomic(path: str | Path, data: Any, indent: int = 2) -> None:
    """Write `data` as JSON to a temporary file beside `path`, then rename it over `path`. Values
    JSON cannot hold are written as their str()."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        make_public(tmp)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=indent, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_outputs(paths: Sequence[Path], force: bool, inputs: Sequence[str | Path | None] = ()) -> None:
    """Fail before any work if an output cannot be written: duplicate paths, one of the command's
    `inputs` (its image, its model file: refused even with --force, which is for earlier outputs),
    a directory in the way, a parent directory that is missing or not writable, or an existing file
    without --force."""
    seen: set[Path] = set()
    existing_inputs = [Path(p).expanduser() for p in inputs if p is not None and Path(p).expanduser().exists()]
    for path in paths:
        key = path.resolve()
        if key in seen:
            raise UserError(f"{path} is named for two different outputs; give each output its own file")
        seen.add(key)
        for given in existing_inputs:
            if path.exists() and os.path.samefile(path, given):
                raise UserError(
                    f"{path} is this command's input {given}: writing it would destroy it; choose another file"
                )
        if path.is_dir():
            raise UserError(f"{path} is a directory; give a file name for the output")
        if not path.parent.is_dir():
            raise UserError(f"directory {path.parent} does not exist; create it first or write elsewhere")
        if path.exists() and not force:
            raise UserError(f"{path} already exists; pass --force to overwrite it")
        try:  # a file made and removed: permissions and read-only mounts, whoever runs this (root too)
            with tempfile.TemporaryFile(dir=path.parent):
                pass
        except OSError as e:
            raise UserError(f"cannot write {path}: {path.parent} is not writable ({e.strerror or e})") from e
