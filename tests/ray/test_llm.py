"""genfast.ray.llm on a two-node Ray cluster: `genfast generate --input --ray` answers each row as
the single-process `genfast.LLM` does, rows that cannot run carry their reason, and a worker
killed mid-run loses nothing (its rows run again)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from genfast.serve.offline import LLM
from tests.llm.hf_fixtures import save_tiny_chat_model
from tests.ray.workers import kill_a_worker_midway

FLAGS = ["--no-compile", "--dtype", "float32", "--device", "cpu", "--max-batch", "2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-ray"), 256)


def rows_of(folder: Path) -> dict:
    rows = [json.loads(line) for path in folder.glob("*.json") for line in path.read_text().splitlines() if line]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a row was written twice"
    return {r["id"]: r for r in rows}


def on_ray(model_dir: Path, source: Path, target: Path, address: str, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "genfast", "generate", "--model", str(model_dir), "--input", str(source),
               "--output", str(target), "--ray", address, "--actors", "2", *FLAGS, *extra]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_rows_equal_the_single_process_answers(model_dir, ray_cluster, tmp_path):
    records = [{"id": i, "prompt": f"w{i + 1} w{i + 2} w{i + 3}"} for i in range(10)]
    records += [
        {"id": 10, "messages": [{"role": "user", "content": "w5 w6"}], "max_new_tokens": 3},
        {"id": 11, "prompt": "w3 " * 300},  # longer than the context
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    process = on_ray(model_dir, source, tmp_path / "out", ray_cluster, "-n", "6")
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    got = rows_of(tmp_path / "out")
    with LLM(str(model_dir), compile=False, dtype="float32", device="cpu", max_batch=2) as llm:
        want = llm.generate([r["prompt"] for r in records[:10]], max_new_tokens=6)
        [reply] = llm.chat(records[10]["messages"], max_new_tokens=3)
    assert [got[i]["text"] for i in range(10)] == [w.text for w in want]
    assert got[10]["text"] == reply.text and got[10]["completion_tokens"] == 3
    assert got[11]["text"] is None and "context holds 256 tokens" in got[11]["error"]
    assert got[0]["prompt"] == records[0]["prompt"]  # input columns come out again


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds Ray's worker processes in /proc")
def test_a_killed_worker_loses_nothing(model_dir, ray_cluster, tmp_path):
    n = 64
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": f"w{i + 1} w{i + 5}"}) + "\n" for i in range(n)))
    process = on_ray(model_dir, source, tmp_path / "out", ray_cluster, "-n", "40")
    try:
        kill_a_worker_midway(process, "LLM", lambda: any((tmp_path / "out").glob("*.json")))
        written_before = len(rows_of(tmp_path / "out"))
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    got = rows_of(tmp_path / "out")
    assert written_before < n  # the kill came before the end
    assert sorted(got) == list(range(n))
    assert all(r["completion_tokens"] == 40 and r["error"] is None for r in got.values())
    with LLM(str(model_dir), compile=False, dtype="float32", device="cpu", max_batch=2) as llm:
        want = llm.generate([f"w{i + 1} w{i + 5}" for i in range(0, n, 9)], max_new_tokens=40)
    assert [got[i]["text"] for i in range(0, n, 9)] == [w.text for w in want]
