"""Prefill and decode compiled ahead of time and kept on disk (genfast/llm/decoding/precompiled.py,
genfast/compilation/artifacts.py): what the key depends on, that saved steps load and give the eager tokens,
that damaged or ill-fitting artifacts are rebuilt with a message, and the CLI's first and second
runs (a background compile, then loaded steps)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from genfast.compilation import artifacts
from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.precompiled import PrecompiledSteps, attach, key_parts, lower_priority
from genfast.llm.decoding.sampling import SamplingParams
from genfast.llm.loading import LoadedModel, load
from genfast.nn import store_linear_weights
from tests.cpus import ZEN4, pretend_cpu
from tests.llm.hf_fixtures import make_hf_model, save_hf_model, word_tokenizer

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    hf = make_hf_model("smollm")
    directory = save_hf_model(hf, tmp_path_factory.mktemp("precompiled") / "smollm")
    word_tokenizer(hf.config.vocab_size).save(directory)
    return directory


def fp32_model(model_dir: Path, bf16_storage: bool = False) -> LoadedModel:
    """The model computing in fp32; `bf16_storage`: its linears' weights and KV cache stored in bf16,
    as `--dtype auto` loads it on a CPU without native bf16."""
    loaded = load(str(model_dir), "cpu", "float32")
    if bf16_storage:
        store_linear_weights(loaded.model, torch.bfloat16)
        loaded.model.cache_dtype = torch.bfloat16
    return loaded


def fp32_generator(
    model_dir: Path, messages: list[str] | None = None, bf16_storage: bool = False
) -> tuple[Generator, PrecompiledSteps]:
    loaded = fp32_model(model_dir, bf16_storage)
    generator = Generator(loaded.model, loaded.tokenizer, max_seq_len=64, compile=True)
    steps = attach(generator, loaded, GREEDY, (messages if messages is not None else []).append)
    assert steps is not None
    return generator, steps


PROMPT = [3, 17, 5, 42, 8, 9]


def eager_tokens(model_dir: Path, bf16_storage: bool = False) -> list[int]:
    loaded = fp32_model(model_dir, bf16_storage)
    return (
        Generator(loaded.model, loaded.tokenizer, max_seq_len=64, compile=False)
        .generate([PROMPT], 12, stop_at_eos=False)
        .token_ids[0]
    )


def test_the_key_follows_what_the_code_depends_on_and_not_the_thread_count(model_dir, monkeypatch):
    loaded = load(str(model_dir), "cpu", "float32")

    def key(**changes) -> str:
        parts = dict(model=loaded.model, dtype_label="float32", quant="none", batch=1, cache_len=64, params=GREEDY)
        parts.update(changes)
        return artifacts.key(key_parts(**parts))

    pretend_cpu(monkeypatch, ZEN4)
    base = key()
    assert key() == base
    assert key(dtype_label="bfloat16") != base and key(quant="int8") != base
    assert key(batch=2) != base and key(cache_len=128) != base and key(params=SamplingParams(0.7)) != base
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert key() == base  # compiled code reads the thread count at run time
    finally:
        torch.set_num_threads(threads)
    pretend_cpu(monkeypatch, ZEN4, isa_cap="avx2")
    assert key() != base
    pretend_cpu(monkeypatch, ZEN4)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert key() != base


def test_compiled_steps_are_saved_and_loaded_and_give_the_eager_tokens(model_dir):
    want = eager_tokens(model_dir)
    first, steps = fp32_generator(model_dir)
    assert steps.start(compile_missing="never") == "no compiled steps saved for this model; eager"
    assert first.generate([PROMPT], 12, stop_at_eos=False).token_ids[0] == want  # eager meanwhile
    first.warmup()  # compiles here, saves
    assert steps.artifacts.complete(["prefill", "decode"])
    assert first.generate([PROMPT], 12, stop_at_eos=False).token_ids[0] == want

    second, loaded_steps = fp32_generator(model_dir)  # another process would do the same
    assert loaded_steps.artifacts.key == steps.artifacts.key
    assert loaded_steps.start().startswith("loaded the compiled steps in")
    loaded_steps.wait()
    assert set(loaded_steps.ready) == {"prefill", "decode"}
    assert second.generate([PROMPT], 12, stop_at_eos=False).token_ids[0] == want
    assert loaded_steps._checked == {"prefill", "decode"}  # the compiled steps ran

    deferred_generator, deferred = fp32_generator(model_dir)  # as `genfast generate` starts
    assert deferred.start(defer=True) == "compiled decode step saved: it loads after the first token"
    assert not deferred.ready  # nothing loaded before the first token
    assert deferred_generator.generate([PROMPT], 12, stop_at_eos=False).token_ids[0] == want
    assert deferred._checked == {"decode"}  # prefilled eagerly, then decoded compiled
    (note,) = deferred.take_notes()
    assert note.startswith("compiled decode loaded in") and deferred.take_notes() == []


def test_steps_saved_with_a_bf16_kv_cache_load_in_another_process(model_dir):
    """`--dtype auto` without native bf16 (fp32 compute, bf16 weights and KV cache). Its saved steps
    failed to load in every later process (torch's guard serializer and a dtype object a module
    held: genfast.nn.DtypeAttribute), so every start recompiled. Saved by a fresh process as
    `genfast generate` saves them: in this one, with the suite's imports, they loaded."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tests.llm.decoding.test_precompiled import fp32_generator\n"
        "messages = []\n"
        f"generator, steps = fp32_generator(Path({str(model_dir)!r}), messages, bf16_storage=True)\n"
        "if sys.argv[1] == 'save':\n"
        "    generator.warmup()\n"
        "    print(steps.artifacts.complete(['prefill', 'decode']))\n"
        "else:\n"
        "    print(steps.start(compile_missing='never'))\n"
        "    print(sorted(steps.ready), messages)\n"
    )
    root = Path(__file__).resolve().parents[3]
    runs = {}
    for step in ("save", "load"):
        run = subprocess.run([sys.executable, "-c", code, step], cwd=root, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[step] = run.stdout + run.stderr[-3000:]
    assert "True" in runs["save"], runs["save"]
    # Loaded, not compiled again after a failed load (which the start message would say).
    assert "loaded the compiled steps in" in runs["load"], runs["load"]
    assert "['decode', 'prefill'] []" in runs["load"], runs["load"]


def test_a_damaged_artifact_is_rebuilt_with_a_message(model_dir):
    generator, steps = fp32_generator(model_dir)
    generator.warmup()
    steps.artifacts.path("decode").write_bytes(b"not a compiled function")
    messages: list[str] = []
    again, fresh = fp32_generator(model_dir, messages)
    assert fresh.start().startswith("compiled decode again in")  # finds the damage, compiles anew
    assert any("could not be loaded" in m and "rebuilt" in m for m in messages)
    assert not any("prefill" in m for m in messages), messages  # the sound artifact is kept
    assert fresh.artifacts.complete(["prefill", "decode"])
    assert again.generate([PROMPT], 12, stop_at_eos=False).token_ids[0] == eager_tokens(model_dir)


def test_a_deferred_step_that_fails_to_load_is_reported_as_compiled_again(model_dir):
    generator, steps = fp32_generator(model_dir)
    generator.warmup()
    steps.artifacts.path("decode").write_bytes(b"not a compiled function")
    deferred_generator, deferred = fp32_generator(model_dir)  # as `genfast generate` starts
    assert deferred.start(defer=True) == "compiled decode step saved: it loads after the first token"
    assert deferred_generator.generate([PROMPT], 12, stop_at_eos=False).token_ids[0] == eager_tokens(model_dir)
    (note,) = deferred.take_notes()
    assert note.startswith("compiled decode again in"), note


def test_steps_that_do_not_fit_the_model_fall_back_to_eager(model_dir, tmp_path):
    """Artifacts compiled for another shape under this key (as a foreign copy would be) fail their
    guards on the first call: discarded with a message, and the run goes on eagerly."""
    other = make_hf_model("llama3")
    other_dir = save_hf_model(other, tmp_path / "llama3")
    word_tokenizer(other.config.vocab_size).save(other_dir)
    foreign, foreign_steps = fp32_generator(other_dir)
    foreign.warmup()
    messages: list[str] = []
    generator, steps = fp32_generator(model_dir, messages)
    steps.artifacts.dir.mkdir(parents=True, exist_ok=True)
    for name in ("prefill", "decode"):
        steps.artifacts.path(name).write_bytes(foreign_steps.artifacts.path(name).read_bytes())
    steps.start()
    steps.wait()
    assert generator.generate([PROMPT], 12, stop_at_eos=False).token_ids[0] == eager_tokens(model_dir)
    assert any("does not fit this model" in m for m in messages)
    assert not steps.artifacts.complete(["prefill"]) and not steps.artifacts.complete(["decode"])


def priorities(pid: int) -> tuple[int, int]:
    """A process's nice value and its session group's (autogroup; the process's own where the
    kernel has no such groups or does not let them be changed here)."""
    nice = os.getpriority(os.PRIO_PROCESS, pid)
    autogroup = Path(f"/proc/{pid}/autogroup")
    if not os.access(autogroup, os.W_OK):
        return nice, nice
    return nice, int(autogroup.read_text().split()[-1])


def test_a_worker_in_its_own_session_gets_the_lowest_priority_against_every_process():
    worker = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert priorities(worker.pid)[0] == os.getpriority(os.PRIO_PROCESS, 0)
        lower_priority(worker.pid)
        assert priorities(worker.pid) == (19, 19)
    finally:
        worker.kill()
        worker.wait()
    lower_priority(worker.pid)  # ended: nothing to do, no error


def test_a_one_shot_run_starts_its_background_compile_only_once_it_has_succeeded(model_dir, monkeypatch):
    generator, steps = fp32_generator(model_dir)
    spawned = []
    monkeypatch.setattr(steps, "_spawn_worker", lambda: spawned.append(1))
    assert "compiled in the background when this run ends" in steps.start("after")
    generator.generate([PROMPT], 4, stop_at_eos=False)
    assert spawned == []  # a run that fails or is interrupted never gets to finish()
    steps.finish()
    steps.finish()
    assert spawned == [1]


def test_a_request_too_long_for_the_cache_fails_before_a_compile_is_planned(model_dir, capsys):
    from genfast.cli import main

    argv = ["generate", "w3 " * 40, "--model", str(model_dir), "--dtype", "float32", "--max-seq-len", "16"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "context holds 16" in err and "compiled in the background" not in err
    assert not (Path(os.environ["GENFAST_HOME"]) / "compiled").exists()


@pytest.mark.alone
def test_the_cli_compiles_in_the_background_then_starts_with_the_compiled_steps(model_dir, tmp_path):
    """First run: streams eagerly and leaves a background compile; second run: prefills eagerly
    and loads the compiled decode step after the first token. Both print the same completion and
    the time to first token from launch."""
    # A fresh GENFAST_HOME holds no saved steps; inductor's cache stays the suite's, which CLI
    # subprocesses share (tests/conftest.py): a cold one only made the background compile slower.
    env = {**os.environ, "GENFAST_HOME": str(tmp_path / "home")}
    argv = [sys.executable, "-m", "genfast", "generate", "w3 w17 w5", "--model", str(model_dir), "--dtype",
            "float32", "-n", "8"]  # fmt: skip
    first = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr
    assert "compiled in the background when this run ends" in first.stderr and "first token" in first.stderr
    compiled = tmp_path / "home" / "compiled"
    deadline = time.monotonic() + 600
    worker_priorities = set()
    while not any(compiled.glob("*/decode.aot")) or any(compiled.glob("*/compiling.lock")):
        assert time.monotonic() < deadline, "the background compile did not finish"
        for lock in compiled.glob("*/compiling.lock"):  # holds the worker's pid
            with contextlib.suppress(OSError, ValueError):  # gone meanwhile, or not written yet
                worker_priorities.add(priorities(int(lock.read_text().split()[0])))
        time.sleep(0.2)
    assert worker_priorities == {(19, 19)}
    for threads in ("2", "1"):  # the background compile ran on one thread: the thread count is no key
        second = subprocess.run([*argv, "--threads", threads], capture_output=True, text=True, timeout=600, env=env)
        assert second.returncode == 0, second.stderr
        assert "; compiled decode loaded in" in second.stderr and "does not fit" not in second.stderr
        assert second.stdout == first.stdout
    listing = subprocess.run([sys.executable, "-m", "genfast", "cache", "list"], capture_output=True, text=True,
                             env=env, timeout=120)  # fmt: skip
    assert "compiled steps (1)" in listing.stdout and "llm generate: prefill and decode" in listing.stdout


def test_a_home_genfast_cannot_write_leaves_runs_eager_and_says_what_is_not_kept(model_dir, tmp_path):
    """A read-only GENFAST_HOME (a container's, say; here a file stands in the way) must not crash
    a run that needs nothing from it: the run is eager, and each thing that could not be kept says
    where it could not go. (Each of these was a traceback: the saved steps' folder after the
    generated text, inductor's cache folder before any.)"""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    home = blocker / "home"
    env = {**os.environ, "GENFAST_HOME": str(home), "GENFAST_KERNEL_DIR": str(home / "kernels")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    argv = [sys.executable, "-m", "genfast", "generate", "w3 w17 w5", "--model", str(model_dir), "--dtype",
            "float32", "-n", "4"]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and "Traceback" not in run.stderr
    assert f"cannot write {home}" in run.stderr and "compiled code goes to" in run.stderr
    assert f"cannot save compiled steps in {home}" in run.stderr
    assert "compiled in the background" not in run.stderr  # nothing was planned that cannot be kept
