"""`genfast bench sam` end to end on a tiny architecture (each step in its own process)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from genfast import cli
from genfast.bench.ladder import measure_row
from genfast.sam.bench import agreement, bench_images, config_json
from tests.cpus import ZEN3, pretend_cpu
from tests.sam.test_attention import FUSABLE


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.json"
    path.write_text(config_json(FUSABLE))
    return path


def test_bench_sam_writes_the_ladder(tiny_config, tmp_path, capsys):
    out = tmp_path / "rows.json"
    ladder = "--steps original,baseline,fused-attention,sparse-2:4 --dtype bfloat16 --repeats 1"
    code = cli.main(
        ["bench", "sam", "--config", str(tiny_config), "--batch-size", "2", *ladder.split(), "--json", str(out)]
    )
    assert code == 0
    rows = {row["step"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["original", "baseline", "fused-attention", "sparse-2:4"]
    for step in ("original", "baseline", "fused-attention"):
        row = rows[step]
        assert row["batch_size"] == 2 and row["img_s"] > 0 and row["peak_mem_gb"] > 0
        assert row["model"] == "custom (random weights)"
    # genfast's fp32 computes what the original computes; bf16 stays within the step's budget.
    assert rows["baseline"]["mask_iou"] >= 0.999 and rows["baseline"]["logit_rel_err"] < 1e-4
    assert rows["fused-attention"]["mask_iou"] >= 0.9 and rows["fused-attention"]["logit_rel_err"] < 0.05
    assert rows["sparse-2:4"]["note"].startswith("skipped") and rows["sparse-2:4"].get("img_s") is None
    table = capsys.readouterr().out
    assert "| original | 2 |" in table and "skipped" in table


def test_bench_sam_automatic_times_both_generators(tiny_config, tmp_path, capsys):
    out = tmp_path / "rows.json"
    grid = "--automatic --all-masks --points-per-side 3 --points-per-batch 4"
    ladder = "--steps original,baseline,bf16 --dtype bfloat16 --repeats 1 --batch-size 1"
    code = cli.main(["bench", "sam", "--config", str(tiny_config), *grid.split(), *ladder.split(), "--json", str(out)])
    assert code == 0
    rows = {row["step"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["original", "baseline", "bf16"]
    assert all(row["img_s"] > 0 and row["masks"] >= 1 for row in rows.values())
    assert "NMS" in rows["original"]["note"]
    # genfast's generator keeps the original's masks in fp32, and close ones in bf16.
    assert rows["baseline"]["mask_iou"] >= 0.999 and rows["bf16"]["mask_iou"] >= 0.9
    captured = capsys.readouterr()
    assert "filters off" in captured.out + captured.err  # the header says what is measured


def test_matched_mask_iou():
    import numpy as np

    from genfast.sam.bench import matched_mask_iou

    def packed(*masks):
        return np.packbits(np.array(masks, dtype=bool), axis=-1)

    a, b, c = [[1, 1, 0, 0] * 2], [[1, 0, 0, 0] * 2], [[0, 0, 1, 1] * 2]
    # Reference masks a and c; ours b (half of a) and c: (0.5 + 1) / 2. An image without ours: 0 each.
    assert matched_mask_iou([packed(a, c)], [packed(b, c)]) == pytest.approx(0.75)
    assert matched_mask_iou([packed(a, c), packed(a)], [packed(b, c), None]) == pytest.approx(1.5 / 3)
    assert matched_mask_iou([None], [packed(a)]) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "baseline,warp"], "unknown step"),
        (["--batch-size", "1,x"], "comma-separated whole numbers"),
        (["--batch-size", "0"], "must be >= 1"),
        (["--model", "vit_z"], "unknown SAM model"),
    ],
)
def test_bench_sam_user_errors(argv, message, capsys):
    assert cli.main(["bench", "sam", *argv]) != 0
    assert message in capsys.readouterr().err


def test_bench_sam_refuses_to_overwrite_json(tiny_config, tmp_path, capsys):
    out = tmp_path / "rows.json"
    out.write_text("keep")
    assert cli.main(["bench", "sam", "--config", str(tiny_config), "--json", str(out)]) != 0
    assert out.read_text() == "keep" and "--force" in capsys.readouterr().err


def test_bench_refuses_a_json_path_it_cannot_write_before_the_run(tiny_config, capsys):
    assert cli.main(["bench", "sam", "--config", str(tiny_config), "--json", "/proc/rows.json"]) == 2
    assert "cannot write /proc/rows.json: /proc is not writable" in capsys.readouterr().err


def test_agreement_and_images():
    images, source = bench_images(3)
    assert len(images) == 3 and all(i.dtype.name == "uint8" and i.ndim == 3 and i.shape[2] == 3 for i in images)
    assert source
    import numpy as np

    a = (np.array([[True, False], [True, True]]), np.array([[1.0, -1.0], [2.0, 3.0]]))
    b = (np.array([[True, True], [False, True]]), np.array([[1.0, 1.0], [2.0, 3.0]]))
    result = agreement([a], [b])
    assert result["mask_iou"] == pytest.approx(2 / 4)
    assert result["logit_rel_err"] == pytest.approx(2 / np.linalg.norm([1, 1, 2, 3]))


def test_attention_memory_estimate_matches_the_measured_peak():
    """vit_b, batch 8: the fp32 step peaked at 21.2 GB (docs/performance.md), its scores ~19 GB."""
    from genfast.sam.bench import attention_scores_bytes
    from genfast.sam.config import sam_preset

    vit_b = sam_preset("vit_b")
    assert 18e9 < attention_scores_bytes("baseline", vit_b, 8) < 21.2e9
    assert attention_scores_bytes("fused-attention", vit_b, 8) == 0
    assert attention_scores_bytes("original", vit_b, 8) == attention_scores_bytes("baseline", vit_b, 1)


def test_the_bf16_row_says_why_it_is_left_out(monkeypatch, tmp_path):
    pretend_cpu(monkeypatch, ZEN3)
    row = measure_row(
        {
            "ladder": "genfast.sam.bench:SamLadder",
            "row": {"step": "bf16", "group": {"batch_size": 1}},
            "options": {
                "device": "cpu",
                "dtype": "auto",
                "repeats": 1,
                "threads": None,
                "config": asdict(FUSABLE),
                "batch_sizes": [1],
            },
            "workdir": str(tmp_path),
        }
    )
    assert row["note"].startswith("skipped: this CPU has no native bf16") and "img_s" not in row
