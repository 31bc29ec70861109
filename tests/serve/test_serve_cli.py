"""`genfast serve` as users run it: the CLI process, graceful shutdown, and the real SmolLM2
answering exactly as `genfast generate` does."""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import subprocess
import sys

import pytest

from genfast.cli import main
from tests.serve.conftest import Server
from tests.serve.test_server import long_stream


def run_generate(*args: str) -> str:
    """`genfast generate`'s completion (stdout without the newline it ends with)."""
    done = subprocess.run([sys.executable, "-m", "genfast", "generate", *args, "-q"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n")
    return done.stdout[:-1]


class _Port:
    def __init__(self, port: int) -> None:
        self.port = port


def test_cli_serves_and_shuts_down_gracefully(tiny_dir):
    """SIGTERM (as Ctrl-C's SIGINT) stops accepting, lets the in-flight stream finish, then exits
    with the signal's status, as uvicorn does (SIGINT: 130, like every genfast command)."""
    proc = subprocess.Popen([sys.executable, "-m", "genfast", "serve", "--model", str(tiny_dir), "--no-compile",
                             "--dtype", "float32", "--port", "0", "--max-batch", "2", "--served-model-name", "tiny"],
                            stderr=subprocess.PIPE, text=True)
    try:
        log = []
        for line in proc.stderr:
            log.append(line)
            if found := re.search(r"running on http://127\.0\.0\.1:(\d+)", line):
                break
        else:
            pytest.fail("the server did not start:\n" + "".join(log))
        assert any("ready in" in line for line in log)
        _, response = long_stream(_Port(int(found.group(1))), max_tokens=600)
        proc.send_signal(signal.SIGTERM)
        events = response.read().decode().split("\n\n")  # the rest of the stream, to its end
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    data = [e.removeprefix("data: ").strip() for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"


def test_serve_without_the_extra_names_the_pip_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve", "--model", "x"]) == 2
    assert "pip install 'genfast[serve]'" in capsys.readouterr().err


@pytest.mark.slow
def test_real_model_greedy_equals_genfast_generate(smollm2_gguf):
    """fp32: in bf16 a batched matmul rounds differently from a one-row one (different kernels and
    accumulation), so greedy continuations can drift apart after a near tie (measured: 4 of 8
    prompts within 48 tokens); in fp32 every row is exactly the single-request computation."""
    from genfast.llm.checkpoint import load_model
    from genfast.llm.generate import Generator
    from genfast.llm.tokenizer import load_tokenizer
    from genfast.serve.engine import Engine

    tokenizer = load_tokenizer(smollm2_gguf)
    server = Server(Engine(load_model(smollm2_gguf), tokenizer, max_batch=4, max_seq_len=512, compile=False),
                    model_name="smollm2")
    try:
        client = server.client()
        cli = ["--model", str(smollm2_gguf), "--no-compile", "--dtype", "float32", "-n", "24"]
        prompt = "The capital of France is"
        got = client.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == run_generate(prompt, *cli)
        question = "Name three colors."
        chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                              max_tokens=24, temperature=0)
        assert chat.choices[0].message.content == run_generate(question, "--chat", *cli)

        # Concurrent streams, each equal to its own single-request run.
        prompts = ["Once upon a time", "def fibonacci(n):\n    ", "The three primary colors are", "In 1969,"]
        single = Generator(load_model(smollm2_gguf), tokenizer, max_seq_len=512, compile=False)
        want = [single.generate([single.encode_prompt(p)], 24).texts[0] for p in prompts]

        def stream(p: str) -> str:
            return "".join(c.choices[0].text for c in client.completions.create(
                model="smollm2", prompt=p, max_tokens=24, temperature=0, stream=True))

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(stream, prompts)) == want
    finally:
        server.close()

