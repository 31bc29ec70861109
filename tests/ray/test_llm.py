"""genfast.ray.llm on a two-node Ray cluster: `genfast generate --input --output --ray` writes the
answers file the single-process command writes (the same answers, bad items named, answered ids
skipped), and a worker killed mid-run loses nothing (its rows run again)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from genfast import cli
from genfast.serve.offline import LLM
from tests.llm.hf_fixtures import save_tiny_chat_model
from tests.ray.workers import run_driver, run_killing_a_worker

FLAGS = ["--no-compile", "--dtype", "float32", "--device", "cpu", "--max-batch", "2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-ray"), 256)


def answers_in(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an answer was written twice"
    return {r["id"]: r for r in rows}


def on_ray_command(model_dir: Path, source: Path, target: Path, address: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "genfast", "generate", "--model", str(model_dir), "--input", str(source),
            "--output", str(target), "--ray", address, "--actors", "2", *FLAGS, *extra]  # fmt: skip


def test_the_answers_file_is_the_single_process_one(model_dir, ray_cluster, tmp_path, capsys):
    records = [{"id": i, "prompt": f"w{i + 1} w{i + 2} w{i + 3}"} for i in range(10)]
    records += [
        {"id": "chat", "messages": [{"role": "user", "content": "w5 w6"}], "max_new_tokens": 3},
        {"id": 11, "prompt": "w3 " * 300},  # longer than the context
        {"id": 12, "prompt": "w4 w9", "temperature": 0.8, "seed": 3, "stop": ["w7"]},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n")
    alone, on_cluster = tmp_path / "alone.jsonl", tmp_path / "ray.jsonl"
    argv = ["generate", "--model", str(model_dir), "--input", str(source), "--output", str(alone), *FLAGS, "-n", "6"]
    assert cli.main(argv) == 1  # the bad items
    capsys.readouterr()
    first = alone.read_text().splitlines()[0]
    on_cluster.write_text(first + "\n")  # answered before: skipped
    done = subprocess.run(on_ray_command(model_dir, source, on_cluster, ray_cluster, "-n", "6"), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stderr
    err = done.stderr
    assert "line 14: not JSON" in err and "line 12: id 11:" in err and "context holds 256 tokens" in err
    assert "done 11, skipped 1 (already in the output), failed 2 on Ray" in err
    got, want = answers_in(on_cluster), answers_in(alone)
    assert got == want and len(got) == 12
    assert got["chat"]["usage"]["completion_tokens"] == 3


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds Ray's worker processes in /proc")
def test_a_killed_worker_loses_nothing(model_dir, ray_cluster, tmp_path):
    n = 64
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": f"w{i + 1} w{i + 5}"}) + "\n" for i in range(n)))
    status, err, written_before = run_killing_a_worker(
        on_ray_command(model_dir, source, target, ray_cluster, "-n", "40"), "LLM",
        lambda: target.exists() and target.stat().st_size > 0, lambda: len(answers_in(target)),
    )  # fmt: skip
    assert status == 0, err
    got = answers_in(target)
    assert written_before < n  # the kill came before the end
    assert sorted(got) == list(range(n))
    assert all(r["usage"]["completion_tokens"] == 40 for r in got.values())
    with LLM(str(model_dir), compile=False, dtype="float32", device="cpu", max_batch=2) as llm:
        want = llm.generate([f"w{i + 1} w{i + 5}" for i in range(0, n, 9)], max_new_tokens=40)
    assert [got[i]["text"] for i in range(0, n, 9)] == [w.text for w in want]


def test_the_ray_data_pipeline_writes_the_input_rows_with_their_answers(model_dir, ray_cluster, tmp_path):
    source, folder, alone = tmp_path / "in.jsonl", tmp_path / "rows", tmp_path / "alone.jsonl"
    source.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"w{i + 2} w{i + 4}"}) + "\n" for i in range(6)))
    llm = {"model": str(model_dir), "compile": False, "dtype": "float32", "device": "cpu", "max_batch": 2}
    script = (
        "import sys; from genfast.ray.llm import generate_jsonl; "
        f"print(generate_jsonl({str(source)!r}, {str(folder)!r}, {llm!r}, sampling={{'max_new_tokens': 5}}, "
        f"address={ray_cluster!r}, concurrency=2))"
    )
    assert run_driver(script) == "6"
    rows = [json.loads(line) for path in folder.glob("*.json") for line in path.read_text().splitlines() if line]
    argv = ["generate", "--model", str(model_dir), "--input", str(source), "--output", str(alone), *FLAGS, "-n", "5"]
    assert cli.main(argv) == 0
    want = answers_in(alone)
    assert sorted(r["id"] for r in rows) == sorted(want)
    for row in rows:
        assert row["text"] == want[row["id"]]["text"] and row["error"] is None
        assert row["prompt"] == f"w{int(row['id'][1:]) + 2} w{int(row['id'][1:]) + 4}"  # input columns come out
