"""The performance page is generated (genfast/bench/report.py): its tables are exactly what its
JSON files give, every file has its table and chart, and every transcribed row names a section of
docs/notes.md that exists."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from genfast.bench.report import image_name, load_rows, main, render, result_files
from genfast.errors import UserError

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGE = DOCS / "performance.md"
# "docs/notes.md, section '<heading>'[, '<subheading>'][ (remark)]"; headings may hold apostrophes.
SECTION = re.compile(r"^docs/notes\.md, section '(?P<section>.+?)'(?:, '(?P<sub>.+)')?(?: \([^)]*\))?$")
BENCHMARK_SCRIPT = re.compile(r"^(?P<path>benchmarks/\w+\.py) --json\b")


def test_the_page_tables_are_what_their_json_files_give(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # comparing the tables needs no charts
    text = PAGE.read_text()
    assert render(text, DOCS) == text, "run: python -m genfast.bench.report docs/performance.md"


def test_every_results_file_has_its_table_and_chart():
    named = result_files(PAGE.read_text())
    kept = sorted(str(p.relative_to(DOCS)) for p in (DOCS / "results").rglob("*.json"))
    assert sorted(named) == kept and len(set(named)) == len(named)
    assert all((DOCS / "images" / image_name(f)).is_file() for f in named)


def test_rows_are_bench_output_or_name_their_section_of_the_notes():
    """A row is what `genfast bench --json` wrote (its timings are there), what a script of
    benchmarks/ wrote with --json (its source names the script, which exists), or a transcription
    that names the section of docs/notes.md it was copied from."""
    headings = {line.lstrip("#").strip() for line in (DOCS / "notes.md").read_text().splitlines() if line[:1] == "#"}
    for json_file in result_files(PAGE.read_text()):
        for row in load_rows(DOCS / json_file):
            assert row["workload"] in ("llm", "sam", "diffusion") and row["speed_key"] and row["device"], json_file
            assert row.get(row["speed_key"]) is not None or row.get("note"), (json_file, row["step"])
            if "source" not in row:
                assert "first_call_s" in row or str(row.get("note")).startswith("skipped"), (json_file, row["step"])
                continue
            script = BENCHMARK_SCRIPT.match(row["source"])
            if script:
                assert (DOCS.parent / script["path"]).is_file(), row["source"]
                continue
            found = SECTION.match(row["source"])
            assert found, (json_file, row.get("source"))
            assert found["section"] in headings, found["section"]
            assert found["sub"] is None or found["sub"] in headings, found["sub"]


def _page(tmp_path: Path, rows: list[dict], body: str = "stale\n") -> Path:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "toy.json").write_text(json.dumps(rows))
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nkept\n\n<!-- results: results/toy.json -->\n{body}<!-- end results -->\n\nkept too\n")
    return page


TOY_ROWS = [
    {"step": "baseline", "workload": "sam", "speed_key": "img_s", "img_s": 0.1, "speedup": 1.0, "device": "Toy CPU"},
    {"step": "sdpa", "workload": "sam", "speed_key": "img_s", "img_s": 0.2, "speedup": 2.0, "mask_iou": 0.98,
     "device": "Toy CPU", "runs": [1.5, 2.5]},
    {"step": "sparse-2:4", "workload": "sam", "speed_key": "img_s", "note": "skipped: no 2:4 kernels on CPU"},
]  # fmt: skip


def test_a_block_is_rewritten_from_its_file_and_the_rest_of_the_page_is_kept(tmp_path):
    page = _page(tmp_path, TOY_ROWS)
    new = render(page.read_text(), tmp_path)
    assert new.startswith("# Title\n\nkept\n\n<!-- results: results/toy.json -->\n![")
    assert new.endswith("<!-- end results -->\n\nkept too\n") and "stale" not in new
    assert "(images/toy.png)" in new
    assert "| sdpa | 0.200 | 2.00 | 0.9800 | - |" in new
    assert "| sparse-2:4 | - | - | - | skipped: no 2:4 kernels on CPU |" in new
    assert "direct `genfast bench --json` output" in new
    assert render(new, tmp_path) == new


def test_check_says_when_the_page_is_stale_and_the_command_mends_it(tmp_path, capsys):
    page = _page(tmp_path, TOY_ROWS)
    assert main(["--check", str(page)]) == 1
    assert main([str(page), "--no-charts"]) == 0
    assert main(["--check", str(page)]) == 0
    assert not (tmp_path / "images").exists()


def test_the_command_draws_each_chart(tmp_path):
    page = _page(tmp_path, TOY_ROWS)
    assert main([str(page)]) == 0
    assert (tmp_path / "images" / "toy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_or_malformed_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_rows(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text('{"step": "baseline"}')
    with pytest.raises(UserError, match="not a list of benchmark rows"):
        load_rows(tmp_path / "bad.json")
    assert image_name("results/zen4-avx512/llm.json") == "zen4-avx512-llm.png"
