"""The `genfast` command line: output streams, exit codes and one-line errors."""

import json
import re
import subprocess
import sys

import pytest

from genfast.cli import main
from genfast.platform import hugepages


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "genfast", *args], capture_output=True, text=True, input=stdin, timeout=600
    )


def test_generate_streams_completion_to_stdout_and_stats_to_stderr(smollm2_gguf):
    done = run_cli(
        "generate",
        "The capital of France is",
        "--model",
        str(smollm2_gguf),
        "--no-compile",
        "--dtype",
        "float32",
        "-n",
        "8",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("Paris")
    assert "decode" in done.stderr and "MBU" in done.stderr and "time to first token" in done.stderr
    assert "Paris" not in done.stderr


def test_generate_batch_and_stdin_prompt(smollm2_gguf):
    done = run_cli(
        "generate",
        "-",
        "The capital of Italy is",
        "--model",
        str(smollm2_gguf),
        "--no-compile",
        "-n",
        "4",
        "-q",
        stdin="The capital of France is",
    )
    assert done.returncode == 0, done.stderr
    france, italy = [json.loads(line) for line in done.stdout.splitlines()]
    assert france["prompt"] == "The capital of France is" and "Paris" in france["completion"]
    assert "Rome" in italy["completion"] and italy["stop_reason"] in ("length", "eos")
    assert done.stderr.count("\n") <= 2  # -q: only the load line


def test_chat_answers_on_stdin(smollm2_gguf):
    # In fp32: this answer's first token is a near-tie ("The" at p 0.152, "L" at 0.140) that bf16's
    # rounding may flip either way.
    done = run_cli(
        "chat",
        "--model",
        str(smollm2_gguf),
        "--dtype",
        "float32",
        "--no-compile",
        "-n",
        "24",
        stdin="What is the capital of France?\n/help\n/resett\nAnd of Italy?\n/exit\n",
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout and "Rome" in done.stdout
    turns = re.findall(r"prompt (\d+) tokens \((\d+) cached\)", done.stderr)
    assert len(turns) == 2 and turns[0][1] == "0"  # commands, known or not, are no turns
    assert "(/reset clears the conversation" in done.stderr and "(unknown command /resett;" in done.stderr
    prompt, cached = map(int, turns[1])  # the second turn prefills only what follows the first
    assert int(turns[0][0]) < cached < prompt


@pytest.mark.parametrize(
    "argv,message",
    [
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
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("genfast: error:") and "Traceback" not in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "hi", "--seed", str(2**70)], "a seed is 0 to"),  # torch's generators crashed on it
        (["serve", "--port", "65536"], "a TCP port is 0 to 65535"),
    ],
)
def test_flag_values_out_of_range_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_prompt_longer_than_context(smollm2_gguf, capsys):
    code = main(["generate", "word " * 50, "--model", str(smollm2_gguf), "--no-compile", "--max-seq-len", "32"])
    assert code == 2
    err = capsys.readouterr().err
    assert "context holds 32 (model limit 8192)" in err
    assert re.search(r"pass --max-seq-len 1[78]\d \(or more\)", err), err  # ~50 prompt tokens + 128 new


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
    done = run_cli(
        "bench",
        "llm",
        "--model",
        str(smollm2_gguf),
        "--steps",
        "baseline,bf16",
        "--dtype",
        "bfloat16",
        "--prompt-tokens",
        "16",
        "--new-tokens",
        "8",
        "--repeats",
        "1",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == ["baseline", "bf16"]
    for row in rows:
        for key in ("decode_tok_s", "prefill_tok_s", "mbu", "peak_mem_gb", "greedy_match"):
            assert row[key] > 0, key
    assert rows[0]["greedy_match"] == 1.0
    assert "| bf16 |" in done.stdout
    assert f"Weights {hugepages.describe()}." in done.stdout  # where decode read them from


@pytest.mark.slow
def test_bench_llm_speculates_for_the_step_spec_target_names(smollm2_gguf, tmp_path):
    """--spec-target: the spec- rows run on that step's model (here the eager bf16 one, as a
    quantized 70B would on one GPU) and report their tokens against its row's."""
    out = tmp_path / "rows.json"
    common = ["--model", str(smollm2_gguf), "--dtype", "bfloat16", "--prompt-tokens", "16", "--new-tokens", "8"]
    done = run_cli("bench", "llm", *common, "--steps", "bf16,spec-prompt-lookup", "--spec-target", "bf16",
                   "--repeats", "1", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == ["bf16", "spec-prompt-lookup"]
    spec = rows[1]
    assert spec["what"].startswith("bf16 step, speculative decoding") and spec["same_as_target"] == 1.0
    assert not spec["compiled"] and spec["tokens_per_pass"] >= 1
    assert main(["bench", "llm", *common, "--spec-target", "warp-speed"]) == 2


def _subparsers(parser) -> dict:
    import argparse

    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _all_parsers(parser, prefix=()):
    yield prefix, parser
    for name, sub in _subparsers(parser).items():
        yield from _all_parsers(sub, (*prefix, name))


def test_every_command_that_runs_a_model_takes_recipe():
    from genfast.cli import build_parser

    parsers = dict(_all_parsers(build_parser()))
    for command in (("generate",), ("chat",), ("serve",), ("segment",), ("imagine",), ("eval", "ppl")):
        help_text = parsers[command].format_help()
        assert "--recipe STEP" in help_text and "baseline" in help_text, command


def test_help_is_public_and_flags_mean_one_thing():
    """No internal flag in any help; --steps is a ladder's rows in every bench, denoising steps are
    --denoising-steps; every bench takes the shared ladder flags."""
    from genfast.cli import build_parser

    for path, parser in _all_parsers(build_parser()):
        text = parser.format_help()
        for internal in ("--one-step", "--baseline-file", "--reference-dir", "--only"):
            assert internal not in text, (path, internal)
        if path[:1] == ("bench",) and len(path) == 2:
            for flag in (
                "--steps STEP,STEP",
                "--list-steps",
                "--repeats",
                "--device",
                "--dtype",
                "--threads",
                "--json",
            ):
                assert flag in text, (path, flag)
        if path in (("imagine",), ("bench", "diffusion")):
            assert "--denoising-steps" in text
    assert "--steps" not in dict(_all_parsers(build_parser()))[("imagine",)].format_help()


def test_parsing_the_command_line_does_not_import_torch():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from genfast.cli import build_parser; build_parser(); "
            "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "False", done.stderr


def test_recipe_baseline_is_eager_fp32(smollm2_gguf):
    """--recipe baseline runs what --no-compile --dtype float32 does (the same tokens), and says so."""
    common = ["generate", "The capital of France is", "--model", str(smollm2_gguf), "-n", "6"]
    baseline = run_cli(*common, "--recipe", "baseline")
    flags = run_cli(*common, "--no-compile", "--dtype", "float32")
    assert baseline.returncode == 0 and flags.returncode == 0, baseline.stderr + flags.stderr
    assert baseline.stdout == flags.stdout and "| float32 on cpu" in baseline.stderr
    assert "compiling" not in baseline.stderr


def test_unknown_recipe_step_is_refused_before_anything_loads():
    done = run_cli("generate", "hi", "--recipe", "warp-speed")
    assert done.returncode == 2 and "invalid choice: 'warp-speed'" in done.stderr
