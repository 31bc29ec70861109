"""The house rules that keep genfast readable as it grows, checked from the source: one way to
apply a recipe (no workload branches on its settings while applying them), and code comments that
state facts rather than dated measurements (those belong in docs/notes.md and the benchmarks).
Import layering and circles: tests/test_layering.py; kernels beside their op schemas:
tests/kernels/test_registry.py."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import genfast

ROOT = Path(genfast.__file__).parent
RECIPES = sorted(ROOT.glob("*/recipe.py"))
DATED = re.compile(r"\b20\d\d-\d\d(-\d\d)?\b")
# A measured speed or bandwidth: tokens/s, GB/s, TB/s, GFLOP/s or s/image, a fractional time in
# ms, or a speed-up ratio such as 1.68x. (Accuracy budgets in dB or % are contracts, and whole
# milliseconds are usually facts such as /proc's 10 ms ticks.)
MEASURED = re.compile(r"\b\d+(\.\d+)?\s*(tok/s|[GT]B/s|GFLOP/s|s/image|s an image)|\b\d+\.\d+\s*(ms\b|x\b)")


def _apply_functions(path: Path) -> list[ast.FunctionDef]:
    return [
        n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name == "apply_recipe"
    ]


def test_every_workload_applies_its_recipe_one_way():
    assert {p.parent.name for p in RECIPES} >= {"llm", "sam", "diffusion"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.parent.name)
def test_no_apply_function_branches_on_its_settings(path):
    """Each step's transforms realize what it sets (genfast/recipe.py: Recipe.apply); an `if` on a
    settings field inside a workload's apply_recipe would be a second mechanism. Checks of which
    combinations can run belong in the workload's validate()."""
    (function,) = _apply_functions(path)
    branches = [
        ast.unparse(node.test)
        for node in ast.walk(function)
        if isinstance(node, ast.If | ast.IfExp)
        and "settings" in {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
    ]
    assert not branches, f"{path.relative_to(ROOT.parent)}: apply_recipe branches on {branches}"


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.append((first.lineno, first.value.value))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def test_code_comments_state_facts_not_dated_measurements():
    """Dates and measured speeds go stale in code; the dated history is docs/notes.md, current
    results docs/performance.md (generated from the benchmarks' JSON)."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        for line, text in _comments_and_docstrings(path):
            for pattern in (DATED, MEASURED):
                if match := pattern.search(text):
                    wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {match.group(0)!r}")
    assert not wrong, "\n".join(wrong)


def test_the_rules_catch_what_they_are_for():
    assert DATED.search("measured 2026-11-27") and DATED.search("since 2026-11")
    assert MEASURED.search("decodes 171.6 tok/s") and MEASURED.search("1.68x bf16") and MEASURED.search("8.1 ms")
    assert not MEASURED.search("PSNR >= 35 dB, IoU >= 0.95, groups of 32, 2x the rows, 10 ms ticks")
