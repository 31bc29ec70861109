"""`genfast serve`: load, compile, then serve the OpenAI API until interrupted."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
from pathlib import Path

from genfast.errors import UserError
from genfast.interface.startup import since_launch
from genfast.storage.hub import DEFAULT_MODEL

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
    before minutes of loading and compiling, and clients are refused (not left waiting) until
    the server is ready. Port 0 picks a free one."""
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

    from genfast.llm.commands import load_announced
    from genfast.llm.recipe import genfast_chooses_threads
    from genfast.llm.tensor_parallel import is_main_rank
    from genfast.serve.app import create_app
    from genfast.serve.engine import Engine

    default_threads = torch.get_num_threads()  # before the load leaves busy CPUs to other work
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
    if not is_main_rank():
        engine.follow()
        return 0
    steps = engine.precompile(loaded, _log)
    if genfast_chooses_threads(args, loaded):
        engine.follow_other_work(default_threads, _log)
    engine.start()
    api_key = args.api_key or os.environ.get("GENFAST_API_KEY") or None
    if args.host not in LOCAL_HOSTS and api_key is None:
        _log(
            f"genfast: warning: serving on {args.host} without an API key: anyone who can reach it can use it "
            "(set --api-key or GENFAST_API_KEY)"
        )
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
    app = create_app(engine, served_model_name(args), api_key, args.shutdown_timeout)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout)
    assert sock is not None  # the main rank bound it
    sock.listen(config.backlog)  # connections from here on wait for uvicorn's first accept
    _log(f"genfast: running on {url_of(sock, args.host)} (Ctrl-C stops it)")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:  # also when uvicorn stops on an error: tensor-parallel followers must stop too
        engine.shutdown()
    return 0
