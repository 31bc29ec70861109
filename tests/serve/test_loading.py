"""`genfast serve` answers while its model loads: /health and /ready say "loading" with 503, the
/v1 routes 503 with Retry-After, /metrics works; then it serves once the model is ready. A load
that fails ends the process with the error and a non-zero status, and Ctrl-C during the load
ends it at once.

The CLI runs as a process whose load waits for a cue on its stdin (no sleeps): the test decides
when the model is "loaded", or that its load fails."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
from email.message import Message
from pathlib import Path

import pytest

from tests.serve.test_server import scrape

# genfast's CLI with the load held until a line comes on stdin: "go" loads the model, any other
# line makes the load fail with that line as its error.
ON_CUE = """
import sys
from genfast import cli
from genfast.errors import UserError
from genfast.serve import commands

load = commands.load_ready_engine

def load_on_cue(args, default_threads):
    cue = sys.stdin.readline().strip()
    if cue != "go":
        raise UserError(f"the model could not load: {cue}")
    return load(args, default_threads)

commands.load_ready_engine = load_on_cue
sys.exit(cli.main(sys.argv[1:]))
"""


class LoadingServer:
    """`genfast serve` on a free port, its load waiting for `cue`; its stderr is collected."""

    def __init__(self, tiny_dir: Path) -> None:
        flags = ["--model", str(tiny_dir), "--no-compile", "--dtype", "float32", "--served-model-name", "tiny"]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ON_CUE, "serve", *flags, "--max-batch", "2", "--port", "0"],
            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.log: list[str] = []
        self.port = int(self.wait_for(r"answering on http://127\.0\.0\.1:(\d+)").group(1))

    def wait_for(self, pattern: str) -> re.Match:
        """The first line of the server's log from here on that matches `pattern`."""
        found: list[re.Match] = []

        def read() -> None:
            for line in self.proc.stderr:
                self.log.append(line)
                if match := re.search(pattern, line):
                    found.append(match)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(300)
        if not found:
            self.proc.kill()
            pytest.fail(f"no {pattern!r} in the server's log:\n" + "".join(self.log))
        return found[0]

    def cue(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, Message, dict]:
        """(status, headers, JSON body) of one request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, json.dumps(body) if body else None, {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = (response.status, response.headers, json.loads(response.read() or b"null"))
        conn.close()
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


COMPLETION = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 3, "temperature": 0}


def test_answers_loading_until_the_model_is_ready_then_serves(tiny_dir):
    server = LoadingServer(tiny_dir)
    try:
        for path in ("/health", "/ready"):
            status, headers, body = server.request("GET", path)
            assert (status, body, headers["Retry-After"]) == (503, {"status": "loading"}, "1"), path
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", COMPLETION)):
            status, headers, answer = server.request(method, path, body)
            assert status == 503 and headers["Retry-After"] == "1", path
            assert answer["error"]["code"] == "model_loading" and "loading" in answer["error"]["message"]
        metrics = scrape(server)
        assert metrics["genfast_generation_tokens_total"] == 0
        assert "vllm:num_requests_running" not in metrics  # no engine yet to read
        server.cue("go")
        server.wait_for(r"running on http://127\.0\.0\.1:")
        assert any("ready in" in line for line in server.log)
        status, _, body = server.request("GET", "/health")
        assert status == 200 and body["status"] == "ok"
        status, _, body = server.request("POST", "/v1/completions", COMPLETION)
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        assert scrape(server)["vllm:num_requests_running"] == 0
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        server.close()


@pytest.mark.parametrize("stop", ["a failed load", "Ctrl-C"])
def test_a_failed_or_interrupted_load_ends_the_process(tiny_dir, stop):
    server = LoadingServer(tiny_dir)
    try:
        assert server.request("GET", "/health")[0] == 503
        if stop == "Ctrl-C":
            server.proc.send_signal(signal.SIGINT)  # the loader still waits for its cue: not waited for
            # Waited for with stdin left open: closing it (communicate) would end the cue's read
            # and fail the load, racing the interrupt.
            server.proc.wait(timeout=60)
        else:
            server.cue("no weights here")
            server.proc.wait(timeout=60)
        err = "".join(server.log) + server.proc.stderr.read()
        if stop == "Ctrl-C":
            assert server.proc.returncode == 130 and "genfast: interrupted" in err, err
        else:
            assert server.proc.returncode == 2, err
            assert "genfast: error: the model could not load: no weights here" in err
    finally:
        server.close()
