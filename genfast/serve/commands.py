"""`genfast serve`: answer at once ("loading"), load and compile meanwhile, then serve the OpenAI
API until interrupted."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from genfast.errors import UserError
from genfast.interface.startup import since_launch
from genfast.storage.hub import DEFAULT_MODEL

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from genfast.llm.loading import LoadedModel
    from genfast.llm.recipe import LlmSettings
    from genfast.serve.engine import Engine

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def require_serve_extra() -> None:
    """FastAPI, uvicorn and prometheus_client are an optional extra: `genfast generate` does not
    need them."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"`genfast serve` needs FastAPI, uvicorn and prometheus_client ({e.name} is missing): "
            "pip install 'genfast[serve]'"
        ) from e


def bind_address(host: str, port: int) -> socket.socket:
    """The server's socket, bound but not yet listening: a taken port or a wrong host is named
    before anything else (on every tensor-parallel rank). Port 0 picks a free one."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise UserError(f"cannot serve on --host {host!r}: {e.strerror}") from e
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restarts need no wait
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(
                f"port {port} on {host} is in use (another server?); choose another --port, or --port 0 for a free one"
            ) from e
        if e.errno == errno.EACCES:
            raise UserError(f"no permission to bind port {port} on {host} (ports below 1024 need privileges)") from e
        raise UserError(f"cannot bind {host} port {port}: {e.strerror}") from e
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def served_model_name(args: argparse.Namespace) -> str:
    """What clients pass as `model`: --served-model-name, else the --model file or directory name."""
    if args.served_model_name:
        return args.served_model_name
    return Path(args.model).name if args.model else DEFAULT_MODEL


def serve_command(args: argparse.Namespace) -> int:
    require_serve_extra()
    from genfast.llm.tensor_parallel import from_main_rank, is_main_rank

    if not is_main_rank():
        # A follower stops when rank 0 says so, after rank 0 has let in-flight requests finish:
        # Ctrl-C and SIGTERM reach every rank, and a follower that died first would cut them off.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    bound: list[socket.socket] = []  # rank 0's; a taken port stops every rank, before the load
    from_main_rank(lambda: bound.append(bind_address(args.host, args.port)))
    sock = bound[0] if bound else None
    try:
        return _serve(args, sock)
    finally:
        if sock is not None:
            sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket | None) -> int:
    import torch
    import uvicorn

    from genfast.llm.tensor_parallel import is_main_rank
    from genfast.serve.app import create_app

    default_threads = torch.get_num_threads()  # before the load leaves busy CPUs to other work
    if not is_main_rank():
        _load(args)[0].follow()
        return 0
    api_key = args.api_key or os.environ.get("GENFAST_API_KEY") or None
    if args.host not in LOCAL_HOSTS and api_key is None:
        _log(
            f"genfast: warning: serving on {args.host} without an API key: anyone who can reach it can use it "
            "(set --api-key or GENFAST_API_KEY)"
        )
    # The server answers while the model loads (503 "loading", genfast/serve/app.py): a probe tells
    # a loading server from a dead one. The load runs on a thread of its own: uvicorn keeps the main
    # thread, where it catches Ctrl-C and SIGTERM.
    app = create_app(None, served_model_name(args), api_key, args.shutdown_timeout)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout)
    server = uvicorn.Server(config)
    assert sock is not None  # the main rank bound it
    sock.listen(config.backlog)  # connections from here on wait for uvicorn's first accept
    url = url_of(sock, args.host)
    _log(f"genfast: answering on {url} while the model loads (/health: 503 until it is ready)")
    loader = _Loader(
        lambda: load_ready_engine(args, default_threads), lambda engine: _start_serving(app, engine, url), server
    )
    try:
        server.run(sockets=[sock])
    finally:  # also when uvicorn stops on an error: tensor-parallel followers must stop too
        loader.stop()
    if loader.failure is not None:
        raise loader.failure  # reported as any failed load (cli.main); the exit status is not 0
    if loader.engine is None:
        # Stopped by a signal before the model was ready. uvicorn re-raises the signal it caught
        # once it has shut down (SIGTERM then ends the process), but a Ctrl-C's re-raise was once
        # lost on a loaded host (the process ended with status 0, not found why): end as an
        # interrupted command does.
        raise KeyboardInterrupt
    return 0


def _load(args: argparse.Namespace) -> tuple[Engine, LoadedModel, LlmSettings]:
    """The model the flags name, in an engine not yet started."""
    from genfast.llm.commands import load_announced
    from genfast.serve.engine import Engine

    loaded, settings = load_announced(args)
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_seq_len=args.max_seq_len,
        compile=settings.compile,
        prefill_chunk=args.prefill_chunk,
        prefix_cache_mib=args.prefix_cache_mib,
    )
    return engine, loaded, settings


def load_ready_engine(args: argparse.Namespace, default_threads: int) -> Engine:
    """The model the flags name, in an engine started and warmed up (compiled), ready to serve;
    `default_threads`: torch's thread count before the load."""
    from genfast.llm.recipe import genfast_chooses_threads

    engine, loaded, settings = _load(args)
    steps = engine.precompile(loaded, _log)
    if genfast_chooses_threads(args, loaded):
        engine.follow_other_work(default_threads, _log)
    engine.start()
    if steps is not None and steps.artifacts.complete(steps.steps.names):
        _log("genfast: loading the compiled prefill and decode...")
    elif steps is not None:
        _log("genfast: compiling prefill and decode, saved for the next start (1-3 minutes on a 2-core CPU)...")
    elif settings.compile:
        _log("genfast: compiling prefill and decode (fast after the first run: the result is cached)...")
    warmup_s = engine.warmup()
    _log(
        f"genfast: ready in {warmup_s:.1f} s ({since_launch():.1f} s after launch): {args.max_batch} slots of "
        f"{engine.max_seq_len} tokens, queue of {args.max_queue}"
    )
    return engine


def _start_serving(app: FastAPI, engine: Engine, url: str) -> None:
    from genfast.serve.app import serve_engine

    serve_engine(app, engine)
    _log(f"genfast: running on {url} (Ctrl-C stops it)")


class _Loader:
    """`load()` (`load_ready_engine`) on a thread of its own, while the server
    answers "loading": the engine goes to `ready` once warmed up; a failure stops the `server`,
    and its caller raises it."""

    def __init__(
        self,
        load: Callable[[], Engine],
        ready: Callable[[Engine], None],
        server: uvicorn.Server,
    ) -> None:
        self.failure: BaseException | None = None
        self.engine: Engine | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._load, self._ready, self._server = load, ready, server
        # A daemon: Ctrl-C during the load ends the process without waiting for it.
        self._thread = threading.Thread(target=self._run, name="genfast-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            engine = self._load()
        except BaseException as e:  # re-raised on the main thread, as a load failing there would be
            self.failure = e
            self._server.should_exit = True
            return
        with self._lock:
            if self._stopped:  # the server stopped while the model loaded (Ctrl-C): nothing to serve
                engine.shutdown()
                return
            self.engine = engine
            self._ready(engine)

    def stop(self) -> None:
        """The server has stopped: shut the engine down (the app's shutdown already did, unless
        uvicorn stopped on an error), or the one a load still under way would bring."""
        with self._lock:
            self._stopped = True
            engine = self.engine
        if engine is not None:
            engine.shutdown()
