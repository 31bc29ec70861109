"""The `genfast` command line: output streams, exit codes and one-line errors."""

import json
import subprocess
import sys

import pytest

from genfast.cli import main


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "genfast", *args], capture_output=True, text=True,
                          input=stdin, timeout=600)


def test_generate_streams_completion_to_stdout_and_stats_to_stderr(smollm2_gguf):
    done = run_cli("generate", "The capital of France is", "--model", str(smollm2_gguf),
                   "--no-compile", "--dtype", "float32", "-n", "8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("Paris")
    assert "decode" in done.stderr and "MBU" in done.stderr and "time to first token" in done.stderr
    assert "Paris" not in done.stderr


def test_generate_batch_and_stdin_prompt(smollm2_gguf):
    done = run_cli("generate", "-", "The capital of Italy is", "--model", str(smollm2_gguf), "--no-compile",
                   "-n", "4", "-q", stdin="The capital of France is")
    assert done.returncode == 0, done.stderr
    france, italy = [json.loads(line) for line in done.stdout.splitlines()]
    assert france["prompt"] == "The capital of France is" and "Paris" in france["completion"]
    assert "Rome" in italy["completion"] and italy["stop_reason"] in ("length", "eos")
    assert done.stderr.count("\n") <= 2  # -q: only the load line


def test_chat_answers_on_stdin(smollm2_gguf):
    done = run_cli("chat", "--model", str(smollm2_gguf), "--no-compile", "-n", "24",
                   stdin="What is the capital of France?\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


@pytest.mark.parametrize("argv,message", [
    (["generate", "hi", "--model", "/no/such/model.gguf"], "does not exist"),
    (["generate", "hi", "--model", "no-such-model"], "model not found"),
    (["generate", "hi"], "genfast pull"),
    (["generate", "hi", "--temperature", "-1", "--model", "x"], "--temperature must be >= 0"),
    (["generate", "hi", "--top-p", "2", "--model", "x"], "--top-p must be in (0, 1]"),
    (["generate", "--model", "x"], "no prompt given"),
    (["generate", "--prompt-file", "/no/such/prompt.txt"], "prompt file not found"),
    (["generate", "hi", "--device", "tpu"], "device"),
    (["generate", "hi", "--dtype", "int3"], "unknown dtype"),
    (["bench", "llm", "--steps", "warp-speed", "--model", "x"], "unknown step"),
    (["pull", "not-a-model"], "unknown model"),
])
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("genfast: error:") and "Traceback" not in err


def test_prompt_longer_than_context(smollm2_gguf, capsys):
    code = main(["generate", "word " * 50, "--model", str(smollm2_gguf), "--no-compile", "--max-seq-len", "32"])
    assert code == 2
    assert "context holds 32" in capsys.readouterr().err


def test_corrupt_gguf(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x07" * 100)
    assert main(["generate", "hi", "--model", str(bad), "--no-compile"]) == 2
    assert "not a readable GGUF" in capsys.readouterr().err


def test_bad_flag_value_exits_nonzero():
    done = run_cli("generate", "hi", "--max-new-tokens", "zero")
    assert done.returncode == 2 and "expected a whole number" in done.stderr


def test_bench_json_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "rows.json"
    out.write_text("keep me")
    assert main(["bench", "llm", "--json", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert out.read_text() == "keep me"


@pytest.mark.slow
def test_bench_llm_writes_json_rows(smollm2_gguf, tmp_path):
    out = tmp_path / "rows.json"
    done = run_cli("bench", "llm", "--model", str(smollm2_gguf), "--steps", "eager-fp32,eager-bf16",
                   "--prompt-tokens", "16", "--new-tokens", "8", "--repeats", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == ["eager-fp32", "eager-bf16"]
    for row in rows:
        for key in ("decode_tok_s", "prefill_tok_s", "mbu", "peak_mem_gb", "greedy_match"):
            assert row[key] > 0, key
    assert rows[0]["greedy_match"] == 1.0
    assert "| eager-bf16 |" in done.stdout
