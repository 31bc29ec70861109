"""A real two-node Ray cluster on this machine (loopback), for the genfast.ray tests: two `ray
start --block` processes in their own sessions and temporary folder, stopped by killing their
process groups (never `ray stop`, which would stop any other Ray on the machine)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray.data")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive_nodes(address: str, env: dict[str, str]) -> int:
    probe = (
        f"import ray; ray.init(address={address!r}, log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """The head node's address; each node offers one CPU."""
    ray = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    address = f"127.0.0.1:{port}"
    # Ray's unix sockets live under its temporary folder and their paths must stay under ~107
    # bytes: a short folder of our own, not pytest's (per-worker paths are long).
    temp = Path(tempfile.mkdtemp(prefix="gf-ray-", dir="/tmp"))
    # Ray's token authentication follows what ~/.ray holds; the nodes and the clients the tests
    # start must agree, whatever this machine's user has set up: off for this loopback cluster.
    settings = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    monkeypatch = pytest.MonkeyPatch()
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    common = ["--block", "--num-cpus=1", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
    head = [ray, "start", "--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false", *common]
    nodes = [
        subprocess.Popen(head, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ]
    try:
        time.sleep(3)
        worker = [ray, "start", f"--address={address}", *common]
        nodes.append(
            subprocess.Popen(
                worker, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
        deadline = time.monotonic() + 120
        while _alive_nodes(address, env) < 2:
            assert all(n.poll() is None for n in nodes), "a Ray node exited while starting"
            assert time.monotonic() < deadline, "the two-node Ray cluster did not start in two minutes"
            time.sleep(1)
        yield address
    finally:
        monkeypatch.undo()
        for node in reversed(nodes):  # a throwaway cluster: no 30-second drain
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)
