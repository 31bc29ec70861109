"""`genfast serve` as users run it: the CLI process, graceful shutdown, and the real SmolLM2
answering exactly as `genfast generate` does."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from genfast.cli import main
from genfast.errors import UserError
from tests.serve.conftest import Server, start_cli_server
from tests.serve.test_server import long_stream, scrape


def run_generate(*args: str) -> str:
    """`genfast generate`'s completion (stdout without the newline it ends with)."""
    done = subprocess.run(
        [sys.executable, "-m", "genfast", "generate", *args, "-q"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n")
    return done.stdout[:-1]


class _Port:
    def __init__(self, port: int) -> None:
        self.port = port


def assert_sigterm_lets_a_stream_finish(proc: subprocess.Popen, port: int, max_tokens: int, timeout: float) -> None:
    """SIGTERM to the server while a stream runs: the stream still ends normally ([DONE] after a
    'length' finish) and the process exits by the signal."""
    _, response = long_stream(_Port(port), max_tokens=max_tokens)
    proc.send_signal(signal.SIGTERM)
    events = response.read().decode().split("\n\n")  # the rest of the stream, to its end
    assert proc.wait(timeout=timeout) == -signal.SIGTERM
    data = [e.removeprefix("data: ").strip() for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"


def test_cli_serves_and_shuts_down_gracefully(tiny_dir):
    """SIGTERM (as Ctrl-C's SIGINT) stops accepting, lets the in-flight stream finish, then exits
    with the signal's status, as uvicorn does (SIGINT: 130, like every genfast command)."""
    # A grace period far above the stream's length: on a loaded 2-core AVX2 machine the 600 tokens
    # took over the default 30 s, and the server rightly cut the stream.
    proc, port = start_cli_server(
        "--model",
        str(tiny_dir),
        "--no-compile",
        "--dtype",
        "float32",
        "--max-batch",
        "2",
        "--served-model-name",
        "tiny",
        "--shutdown-timeout",
        "180",
        "--prefix-cache-mib",
        "3",
    )
    try:
        metrics = scrape(_Port(port))
        assert metrics["genfast_prefix_cache_budget_bytes"] == 3 * 2**20
        assert_sigterm_lets_a_stream_finish(proc, port, max_tokens=600, timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_without_the_extra_names_the_pip_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve", "--model", "x"]) == 2
    assert "pip install 'genfast[serve]'" in capsys.readouterr().err


def test_a_taken_port_or_foreign_address_is_named_before_the_model_loads(tiny_dir, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tiny_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err and "parameters" not in err, err
    assert main(["serve", "--model", str(tiny_dir), "--host", "192.0.2.1"]) == 2  # TEST-NET: not this machine's
    assert "cannot bind 192.0.2.1 port 8000" in capsys.readouterr().err


def test_the_port_is_bound_first_and_listens_only_once_the_server_starts():
    from genfast.serve.commands import bind_address, url_of

    sock = bind_address("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port > 0 and url_of(sock, "127.0.0.1") == f"http://127.0.0.1:{port}"
        with pytest.raises(ConnectionRefusedError):  # not listening yet (tests/serve/test_loading.py: then 503)
            socket.create_connection(("127.0.0.1", port), timeout=5)
        with pytest.raises(UserError, match="in use"):
            sock.listen()  # once listening, a second server on the port is refused at once
            bind_address("127.0.0.1", port)
    finally:
        sock.close()


@pytest.mark.slow
def test_real_model_greedy_equals_genfast_generate(smollm2_gguf):
    """fp32: in bf16 a batched matmul rounds differently from a one-row one (different kernels and
    accumulation), so greedy continuations can drift apart after a near tie (measured: 4 of 8
    prompts within 48 tokens); in fp32 every row is exactly the single-request computation."""
    from genfast.llm.checkpoints.checkpoint import Checkpoint
    from genfast.llm.checkpoints.tokenizer import load_tokenizer
    from genfast.llm.checkpoints.weights import load_model
    from genfast.llm.decoding.generate import Generator
    from genfast.serve.engine import Engine

    checkpoint = Checkpoint.open(smollm2_gguf)
    tokenizer = load_tokenizer(checkpoint)
    server = Server(
        Engine(load_model(checkpoint), tokenizer, max_batch=4, max_seq_len=512, compile=False), model_name="smollm2"
    )
    try:
        client = server.client()
        cli = ["--model", str(smollm2_gguf), "--no-compile", "--dtype", "float32", "-n", "24"]
        prompt = "The capital of France is"
        got = client.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == run_generate(prompt, *cli)
        question = "Name three colors."
        chat = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
        )
        assert chat.choices[0].message.content == run_generate(question, "--chat", *cli)

        # Concurrent streams, each equal to its own single-request run.
        prompts = ["Once upon a time", "def fibonacci(n):\n    ", "The three primary colors are", "In 1969,"]
        single = Generator(load_model(checkpoint), tokenizer, max_seq_len=512, compile=False)
        want = [single.generate([single.encode_prompt(p)], 24).texts[0] for p in prompts]

        def stream(p: str) -> str:
            return "".join(
                c.choices[0].text
                for c in client.completions.create(model="smollm2", prompt=p, max_tokens=24, temperature=0, stream=True)
            )

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(stream, prompts)) == want
    finally:
        server.close()


def _children(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def test_tensor_parallel_server_answers_as_one_process_and_stops_every_rank(tiny_dir):
    """`serve --tp 2`, compiled: rank 0 schedules and the other rank mirrors each prefill and
    decode (their compiled graphs must match collective for collective, or both would hang).
    Concurrent greedy requests, more than the slots so one joins mid-way, equal a one-process
    engine's answers (fp32: the two ranks' logits agree with TP=1 within ~1e-7). SIGTERM to
    the launcher lets the in-flight stream finish and stops both ranks."""
    import openai

    from genfast.serve.engine import Engine
    from tests.serve.conftest import load_tiny

    prompts = ["w1 w2 w3", "w5 w6 w7 w8 w9", "w100", "w7 w7 w7 w7"]

    def complete(client: openai.OpenAI, prompt: str) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    single = Server(Engine(*load_tiny(tiny_dir), max_batch=1, compile=False))
    try:
        want = [complete(single.client(), p) for p in prompts]
    finally:
        single.close()

    proc, port = start_cli_server(
        "--model", str(tiny_dir), "--tp", "2", "--dtype", "float32", "--max-batch", "2", "--served-model-name", "tiny"
    )
    try:
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(lambda p: complete(client, p), prompts)) == want
        assert_sigterm_lets_a_stream_finish(proc, port, max_tokens=400, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in ranks:  # none left behind
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
