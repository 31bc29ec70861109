"""`genfast generate --input prompts.jsonl --output answers.jsonl`: answers equal one-prompt
generation; a re-run skips what is done; a kill halfway loses and repeats nothing; bad items are
named and left out while the rest run."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from genfast.cli import main
from genfast.interface.progress import Progress
from genfast.serve.batch_file import completed_ids
from tests.llm.hf_fixtures import save_tiny_chat_model

CONTEXT = 256
FLAGS = ["--no-compile", "--dtype", "float32", "--device", "cpu", "--threads", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-batch"), CONTEXT)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def answers(path: Path) -> dict:
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "an id was answered twice"
    return {r["id"]: r for r in records}


def generate(model_dir: Path, source: Path, target: Path, *extra: str) -> int:
    return main(
        ["generate", "--model", str(model_dir), "--input", str(source), "--output", str(target), *FLAGS, *extra]
    )


def test_answers_equal_the_python_api_and_carry_usage(model_dir, tmp_path):
    from genfast.serve.offline import LLM

    records = [{"id": i, "prompt": " ".join(f"w{(7 * i + j) % 300}" for j in range(1 + i % 5))} for i in range(9)]
    records.append({"id": "chat", "messages": [{"role": "user", "content": "w5 w6"}], "max_new_tokens": 3})
    source = write_jsonl(tmp_path / "in.jsonl", records)
    assert generate(model_dir, source, tmp_path / "out" / "answers.jsonl", "-n", "6", "--max-batch", "3") == 0
    got = answers(tmp_path / "out" / "answers.jsonl")
    with LLM(str(model_dir), compile=False, dtype="float32", device="cpu", max_batch=1) as llm:
        want = llm.generate([r["prompt"] for r in records[:-1]], max_new_tokens=6)
        [reply] = llm.chat(records[-1]["messages"], max_new_tokens=3)
    assert [got[i]["text"] for i in range(9)] == [w.text for w in want]
    assert got["chat"]["text"] == reply.text and got["chat"]["usage"]["completion_tokens"] == 3
    assert got[4]["usage"] == {"prompt_tokens": 5, "completion_tokens": 6}
    assert got[0]["finish_reason"] == "length"


def test_bad_items_are_named_and_the_rest_run(model_dir, tmp_path, capsys):
    source = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": "a", "prompt": "w1 w2"},
            "{not json",
            {"prompt": "w3"},  # no id
            {"id": "a", "prompt": "w4"},  # a repeated id
            {"id": "both", "prompt": "w5", "messages": [{"role": "user", "content": "w6"}]},
            {"id": "long", "prompt": "w7 " * (CONTEXT - 2)},  # too long with the new tokens
            {"id": "typo", "prompt": "w8", "temprature": 0.5},
            {"id": "kind", "prompt": "w8", "max_new_tokens": "many"},
            "",
            {"id": "b", "prompt": "w9 w10"},
        ],
    )
    target = tmp_path / "answers.jsonl"
    assert generate(model_dir, source, target, "-n", "4") == 1  # some were left out
    assert set(answers(target)) == {"a", "b"}
    err = capsys.readouterr().err
    assert "line 2: not JSON" in err
    assert 'line 3: no "id"' in err
    assert 'line 4: id "a" repeats' in err
    assert 'line 5: id "both": give exactly one of "prompt"' in err
    assert 'line 6: id "long": this model\'s context holds 256 tokens' in err
    assert 'line 7: id "typo": unknown fields temprature' in err
    assert 'line 8: id "kind": "max_new_tokens" must be int' in err
    assert "done 2, skipped 0 (already in the output), failed 7" in err


def test_a_rerun_skips_what_is_done_and_repairs_a_cut_line(model_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"w{i + 1} w{i + 2}"} for i in range(6)])
    target = tmp_path / "answers.jsonl"
    assert generate(model_dir, source, target, "-n", "3") == 0
    complete = target.read_text().splitlines()
    # Keep three answers and half of a fourth, as if the machine went down mid-write.
    target.write_text("\n".join(complete[:3]) + "\n" + complete[3][: len(complete[3]) // 2])
    capsys.readouterr()
    assert generate(model_dir, source, target, "-n", "3") == 0
    assert "done 3, skipped 3" in capsys.readouterr().err
    assert sorted(answers(target)) == list(range(6))
    assert generate(model_dir, source, target, "-n", "3") == 0  # nothing left to do
    assert "done 0, skipped 6" in capsys.readouterr().err


def test_killed_halfway_then_rerun_answers_each_item_exactly_once(model_dir, tmp_path):
    n = 48
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"w{i + 1} w{i + 3} w{i + 5}"} for i in range(n)])
    target = tmp_path / "answers.jsonl"
    command = [sys.executable, "-m", "genfast", "generate", "--model", str(model_dir), "--input", str(source),
               "--output", str(target), "-n", "40", "--max-batch", "2", *FLAGS]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (target.exists() and target.read_text().count("\n") >= 4):
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "no answers within two minutes"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
        process.stderr.close()
    first = answers(target)  # every line written is whole (answers() parses each)
    assert 4 <= len(first) < n
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"done {n - len(first)}, skipped {len(first)}" in rerun.stderr
    final = answers(target)
    assert sorted(final) == list(range(n))
    assert all(final[i] == first[i] for i in first)  # the first run's answers stay as they were


def test_flag_errors(model_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "w1"}])
    cases = [
        (["--input", str(source)], "--input and --output go together"),
        (["--input", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o.jsonl")], "input file not found"),
        (["--input", str(source), "--output", str(source)], "--output must be another file"),
        (["w1 w2", "--input", str(source), "--output", str(tmp_path / "o.jsonl")], "drop the prompt arguments"),
    ]
    for flags, message in cases:
        assert main(["generate", "--model", str(model_dir), *flags, *FLAGS]) == 2
        assert message in capsys.readouterr().err
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text("my own notes\n")
    assert generate(model_dir, source, foreign) == 2
    assert "is not an answer genfast wrote" in capsys.readouterr().err
    assert foreign.read_text() == "my own notes\n"  # never overwritten


def test_completed_ids_of_a_missing_file_is_empty(tmp_path):
    assert completed_ids(tmp_path / "none.jsonl") == set()


def test_progress_says_the_time_left():
    stream = io.StringIO()
    progress = Progress(4, "answers", stream)
    progress.advance()
    assert "answers 1/4" in stream.getvalue() and "left)" in stream.getvalue()
    progress.advance(3)
    assert (
        stream.getvalue().splitlines()[-1].startswith("answers 4/4")
        and "left" not in stream.getvalue().splitlines()[-1]
    )
