"""genfast/storage/files.py: outputs checked before the work, written whole, with the modes of plain files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from genfast.errors import UserError
from genfast.storage.files import check_outputs, make_public, write_json_atomic


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_json_outputs_get_a_plain_files_mode_not_mkstemps(tmp_path, umask_022):
    path = tmp_path / "rows.json"
    write_json_atomic(path, {"a": 1})
    assert mode(path) == 0o644 and path.read_text() == '{\n  "a": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]


def test_make_public_follows_the_umask(tmp_path):
    private_file, private_dir = tmp_path / "f", tmp_path / "d"
    private_file.touch(mode=0o600)
    private_dir.mkdir(mode=0o700)
    before = os.umask(0o027)
    try:
        make_public(private_file)
        make_public(private_dir)
    finally:
        os.umask(before)
    assert mode(private_file) == 0o640 and mode(private_dir) == 0o750


def test_an_input_is_never_an_output_even_with_force(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    (tmp_path / "alias.gguf").hardlink_to(model)
    for output in (model, tmp_path / "alias.gguf"):
        with pytest.raises(UserError, match="this command's input"):
            check_outputs([output], force=True, inputs=[None, "not-a-file", model])
    check_outputs([tmp_path / "rows.json"], force=True, inputs=[model])  # another file: fine
    assert model.read_bytes() == b"GGUF"
