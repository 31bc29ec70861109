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


def write_json_atomic(path: str | Path, data: Any, indent: int = 2) -> None:
    """Write `data` as JSON to a temporary file beside `path`, then rename it over `path`. Values
    JSON cannot hold are written as their str()."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=indent, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_outputs(paths: Sequence[Path], force: bool) -> None:
    """Fail before any work if an output cannot be written: duplicate paths, a directory in the way,
    a parent directory that is missing or not writable, or an existing file without --force."""
    seen: set[Path] = set()
    for path in paths:
        key = path.resolve()
        if key in seen:
            raise UserError(f"{path} is named for two different outputs; give each output its own file")
        seen.add(key)
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
