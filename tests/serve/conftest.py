"""A tiny random model on disk and real uvicorn servers on free localhost ports, for the server tests."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.llm.hf_fixtures import TINY_CONFIGS, hf_model_from_config, save_hf_model, word_tokenizer

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

# Plain "w1 w2 ..." text: the chat template joins the turns, so chat prompts are word prompts too.
TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
VOCAB = TINY_CONFIGS["llama3"]["vocab_size"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny llama3 test model with a 1,024-token context (long requests for the cancellation
    and shutdown tests) and a word tokenizer with a chat template, saved as a HF directory."""
    hf = hf_model_from_config(dict(TINY_CONFIGS["llama3"], max_position_embeddings=1024))
    directory = save_hf_model(hf, tmp_path_factory.mktemp("tiny-serve"))
    tok = word_tokenizer(VOCAB)
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save(directory)
    return directory


def load_tiny(directory: Path):
    """A fresh (model, tokenizer): every engine needs its own model, since the KV caches live in it."""
    from genfast.llm.checkpoints.checkpoint import Checkpoint
    from genfast.llm.checkpoints.tokenizer import load_tokenizer
    from genfast.llm.checkpoints.weights import load_model

    checkpoint = Checkpoint.open(directory)
    return load_model(checkpoint), load_tokenizer(checkpoint)


def words(*numbers: int) -> str:
    return " ".join(f"w{n}" for n in numbers)


class Server:
    """`create_app(engine)` served by uvicorn on a free localhost port, in a background thread."""

    def __init__(self, engine, model_name: str = "tiny", api_key: str | None = None) -> None:
        import uvicorn

        from genfast.serve.app import create_app

        self.engine = engine.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(engine, model_name, api_key), log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def client(self, api_key: str = "unused", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def serve(tiny_dir) -> Iterator:
    """serve(**engine_kwargs) -> a running Server on a fresh tiny eager engine; all closed at teardown."""
    from genfast.serve.engine import Engine

    servers: list[Server] = []

    def start(api_key: str | None = None, **engine_kwargs) -> Server:
        model, tok = load_tiny(tiny_dir)
        engine_kwargs.setdefault("compile", False)
        servers.append(Server(Engine(model, tok, **engine_kwargs), api_key=api_key))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.fixture(scope="session")
def smollm2_server(smollm2_gguf) -> Iterator[Server]:
    """The real SmolLM2-135M-Instruct (eager fp32, 4 slots) served as "smollm2": for replies whose
    form matters (structured output, tool calls)."""
    from genfast.llm.loading import load
    from genfast.serve.engine import Engine

    loaded = load(str(smollm2_gguf), "cpu", "float32")
    server = Server(Engine(loaded.model, loaded.tokenizer, max_batch=4, max_seq_len=1024, compile=False), "smollm2")
    yield server
    server.close()


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def start_cli_server(*args: str, timeout: float = 300.0) -> tuple[subprocess.Popen, int]:
    """`genfast serve *args --port 0` as a process; returns it and its port once it listens (the
    caller stops it). Fails with the server's log if it does not start within `timeout`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "genfast", "serve", *args, "--port", "0"], stderr=subprocess.PIPE, text=True
    )
    log: list[str] = []
    found: list[int] = []

    def read() -> None:
        for line in proc.stderr:
            log.append(line)
            if match := re.search(r"running on http://127\.0\.0\.1:(\d+)", line):
                found.append(int(match.group(1)))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        proc.kill()
        pytest.fail("the server did not start:\n" + "".join(log))
    assert any("ready in" in line for line in log)
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining: a full pipe would block it
    return proc, found[0]
