"""The suite's two xdist workers (tests/sharing.py): an `alone` test overlaps no other test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """
import pytest

from tests.sharing import share_of_the_machine


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: runs while no other test does")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with share_of_the_machine(item):
        return (yield)
"""

RECORD = """
import os
import time

import pytest


def record(name):
    start = time.monotonic()
    time.sleep(0.3)
    with open(os.environ["INTERVALS"], "a") as log:
        log.write(f"{name} {start} {time.monotonic()}\\n")
"""


def test_an_alone_test_runs_while_no_other_test_does(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_many.py").write_text(
        RECORD + "\n@pytest.mark.parametrize('i', range(6))\ndef test_shared(i):\n    record(f'shared{i}')\n"
    )
    (suite / "test_few.py").write_text(
        RECORD
        + "\ndef test_before():\n    record('before')\n"
        + "\n@pytest.mark.alone\ndef test_alone():\n    record('alone')\n"
        + "\ndef test_after():\n    record('after')\n"
    )
    intervals = tmp_path / "intervals.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "INTERVALS": str(intervals)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider", "-q", str(suite)],
        cwd=suite, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    spans = {
        name: (float(start), float(end)) for name, start, end in map(str.split, intervals.read_text().splitlines())
    }
    assert len(spans) == 9

    def overlap(a: str, b: str) -> bool:
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]

    others = [name for name in spans if name != "alone"]
    assert not [name for name in others if overlap("alone", name)]
    assert any(overlap(a, b) for a in others for b in others if a < b)  # the workers did run side by side
