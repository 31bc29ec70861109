"""`genfast bench ... --plot`: the ladder drawn as a PNG from its rows (genfast/bench/plot.py), the
one-line error without matplotlib, and the rule that an existing file needs --force."""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import pytest

from genfast.bench import ladder as ladder_module
from genfast.bench.plot import accuracy_text, plot_rows, require_matplotlib, speedups
from genfast.errors import UserError
from tests.bench.test_ladder import ToyLadder

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's header chunk (IHDR comes first)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _fake_rows() -> list[dict]:
    return [
        {"step": "original", "batch_size": 1, "group": ["batch_size"], "img_s": 0.1, "speedup": 1.0},
        {"step": "bf16", "batch_size": 1, "group": ["batch_size"], "img_s": 0.25, "speedup": 2.5, "mask_iou": 0.98},
        {"step": "sparse-2:4", "batch_size": 1, "group": ["batch_size"], "note": "skipped: no 2:4 kernels on CPU"},
        {"step": "compile", "batch_size": 1, "group": ["batch_size"], "note": "failed (see the error)"},
        {"step": "dynamic-int8", "batch_size": 1, "group": ["batch_size"], "img_s": 0.05, "speedup": 0.5,
         "mask_iou": 0.97},
    ]  # fmt: skip


def _tagged(rows: list[dict]) -> list[dict]:
    machine = {"device": "Toy CPU (2 threads)", "isa": "avx2", "torch": "2.13.0+cpu", "model": "toy"}
    tags = {"workload": "sam", "speed_key": "img_s", "higher_is_faster": True, "accuracy_key": "mask_iou"}
    return [{**row, **machine, **tags} for row in rows]


def test_a_ladder_is_drawn_as_a_png_with_its_skipped_and_failed_rows(tmp_path):
    path = tmp_path / "ladder.png"
    plot_rows(_tagged(_fake_rows()), path)
    width, height = _png_size(path)
    assert width >= 600 and height >= 400
    assert path.stat().st_size > 10_000  # bars, labels and a title, not an empty canvas
    assert not [p for p in tmp_path.iterdir() if p != path]  # no temporary file left beside it


def test_the_same_rows_draw_the_same_bytes(tmp_path):
    rows = _tagged(_fake_rows())
    plot_rows(rows, tmp_path / "a.png")
    plot_rows(rows, tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_rows_without_a_speed_up_are_compared_with_the_first_row_of_their_group():
    rows = [
        {"step": "compile", "s_per_image": 4.0, "speed_key": "s_per_image", "higher_is_faster": False},
        {"step": "int8", "s_per_image": 2.0, "speed_key": "s_per_image", "higher_is_faster": False},
        {"step": "int4", "note": "skipped: needs a GPU", "speed_key": "s_per_image", "higher_is_faster": False},
    ]
    values, against = speedups(rows)
    assert values == [1.0, 2.0, None] and against == "vs compile"
    values, against = speedups([{**r, "speedup": s} for r, s in zip(rows, (1.0, 2.0, None))])
    assert values == [1.0, 2.0, None] and against == "vs compile"


def test_the_accuracy_figure_is_written_by_its_kind():
    assert accuracy_text({"accuracy_key": "mask_iou", "mask_iou": 0.97654}) == "IoU 0.977"
    assert accuracy_text({"accuracy_key": "psnr_db", "psnr_db": 48.55}) == "PSNR 48.5 dB"
    assert accuracy_text({"accuracy_key": "greedy_match", "greedy_match": 0.08}) == "greedy 8%"
    assert accuracy_text({"accuracy_key": "mask_iou"}) is None
    assert accuracy_text({"step": "baseline"}) is None


def test_each_workload_ladder_names_its_accuracy_column():
    from genfast.diffusion.bench import DiffusionLadder
    from genfast.llm.bench import LlmLadder
    from genfast.sam.bench import SamAutomaticLadder, SamLadder

    assert LlmLadder().accuracy_key == "greedy_match"
    assert SamLadder().accuracy_key == SamAutomaticLadder().accuracy_key == "mask_iou"
    assert DiffusionLadder().accuracy_key == "psnr_db"


@pytest.fixture
def no_matplotlib(monkeypatch):
    """matplotlib as if not installed: importing it raises ImportError."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def _args(tmp_path: Path, **changes) -> argparse.Namespace:
    args = argparse.Namespace(list_steps=False, json_path=None, plot_path=str(tmp_path / "ladder.png"), force=False,
                              steps="baseline,half", device="cpu", dtype="auto", repeats=1, threads=None)  # fmt: skip
    vars(args).update(changes)
    return args


def _no_rows_may_run(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a row ran although the command should have failed first")

    monkeypatch.setattr(ladder_module, "_run_isolated", fail)


def test_without_matplotlib_plot_fails_in_one_line_before_the_ladder_runs(tmp_path, monkeypatch, no_matplotlib):
    with pytest.raises(UserError, match=r"pip install genfast\[plot\]") as error:
        require_matplotlib()
    assert "\n" not in str(error.value)
    _no_rows_may_run(monkeypatch)
    with pytest.raises(UserError, match=r"pip install genfast\[plot\]"):
        ladder_module.run(ToyLadder(), _args(tmp_path))
    assert not (tmp_path / "ladder.png").exists()


def test_an_existing_plot_is_not_overwritten_without_force(tmp_path, monkeypatch):
    existing = tmp_path / "ladder.png"
    existing.write_bytes(b"mine")
    with monkeypatch.context() as patch:
        _no_rows_may_run(patch)
        with pytest.raises(UserError, match="already exists; pass --force"):
            ladder_module.run(ToyLadder(), _args(tmp_path))
        # --json and --plot naming one file is refused too, before any row runs
        with pytest.raises(UserError, match="named for two different outputs"):
            ladder_module.run(ToyLadder(), _args(tmp_path, json_path=str(existing), force=True))
    assert existing.read_bytes() == b"mine"
    out = tmp_path / "rows.json"
    assert ladder_module.run(ToyLadder(), _args(tmp_path, json_path=str(out), force=True)) == 0
    assert existing.read_bytes()[:8] == PNG_SIGNATURE
    rows = json.loads(out.read_text())  # the rows carry what a chart needs to be drawn again from them
    assert all(r["workload"] == "toy" and r["speed_key"] == "seconds" and r["higher_is_faster"] is False for r in rows)
    assert all("accuracy_key" in r for r in rows)
    plot_rows(rows, tmp_path / "again.png")
    assert _png_size(tmp_path / "again.png")[0] >= 600
