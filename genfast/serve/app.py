"""The HTTP layer: a FastAPI app serving an `Engine` with OpenAI's API.

Routes: GET /health, GET /ready and GET /metrics (Prometheus text; no key needed for these), GET /v1/models,
POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events ending in
`data: [DONE]` when `stream` is true). Every error is an OpenAI error object. The engine runs on
its own thread; each request's events cross into the event loop through a `_Bridge`. A client
that disconnects cancels its request, which frees its slot at the next decode step.

The app answers from before the model is loaded (genfast/serve/commands.py loads it meanwhile):
until `serve_engine` hands it the engine, /health and /ready say "loading" with 503, the /v1
routes answer 503 with Retry-After, and /metrics has its counters (at zero) without the
engine's gauges. A probe then tells a loading server (503) from a dead one (no answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from genfast.errors import UserError
from genfast.llm.decoding.sampling import SamplingParams
from genfast.serve.engine import (
    Delta,
    Engine,
    EngineStopped,
    Event,
    Finished,
    GenerationRequest,
    QueueFull,
    Ticket,
    TokenLogprob,
)
from genfast.serve.metrics import ServeMetrics
from genfast.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationBody,
    ResponseHeader,
)
from genfast.serve.tools import with_tool_instructions

# How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.5


class _Bridge:
    """A request's engine events, carried from the engine thread into the event loop."""

    def __init__(self, only_final: bool = False) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.only_final = only_final  # drop Deltas (a non-streamed response needs only Finished)

    def __call__(self, event: Event) -> None:  # called on the engine thread
        if self.only_final and isinstance(event, Delta):
            return
        # RuntimeError: the loop is closed (server gone): nobody is waiting for this event.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def create_app(
    engine: Engine | None, model_name: str, api_key: str | None = None, shutdown_timeout: float = 0.0
) -> FastAPI:
    """An app serving `engine` as `model_name`; with `api_key`, /v1/* needs `Authorization: Bearer KEY`.

    The engine must be started (and warmed up) by the caller; None: it is still loading, and
    `serve_engine` hands it over once it is. The app shuts it down when the server stops,
    letting in-flight requests finish for up to `shutdown_timeout` seconds.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if (served := app.state.engine) is not None:
            await asyncio.to_thread(served.shutdown, shutdown_timeout)

    app = FastAPI(title="genfast", lifespan=lifespan)
    created = int(time.time())
    app.state.engine = None
    app.state.metrics = ServeMetrics(lambda: app.state.engine)
    if engine is not None:
        serve_engine(app, engine)

    def loaded() -> Engine:
        """The engine; a 503 "loading" answer while there is none yet."""
        served = app.state.engine
        if served is None:
            raise APIError(503, "the model is loading; retry later", "server_error", code="model_loading")
        return served

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_error(e).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:  # a bug; uvicorn logs the traceback
        return JSONResponse(
            APIError(500, f"internal error: {type(e).__name__}", "server_error").body(), status_code=500
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:  # 404, 405, ...
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        engine = app.state.engine
        if engine is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
        stats = asdict(engine.stats())
        if engine.stopping:
            return JSONResponse({"status": "shutting_down", **stats}, status_code=503)
        return JSONResponse({"status": "ok", **stats})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        # Readiness for a load balancer: 503 while the model loads, and once shutting down
        # (in-flight requests finishing: send no more).
        engine = app.state.engine
        if engine is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
        if engine.stopping:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = app.state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models() -> dict[str, Any]:
        engine = loaded()
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "genfast",
                    "max_model_len": engine.max_seq_len,
                }
            ],
        }

    @app.post("/v1/completions", dependencies=[Depends(check_key)], response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
        engine = loaded()
        prompt = body.single_prompt()
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return await serve(engine, body, ids, body.max_tokens or 16, ResponseHeader("completion", model_name), request)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)], response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
        engine = loaded()
        tokenizer = engine.tokenizer
        messages, tools = body.conversation(), None
        if tokenizer.harmony and body.forced_call:
            # The forced call's grammar is a bare JSON object; a harmony reply must open with a header.
            raise APIError(
                400, "tool_choice 'required' or a named function is not supported for harmony models (gpt-oss): "
                "use 'auto'", param="tool_choice",
            )  # fmt: skip
        if body.tools_active:  # the template's own tool rendering, or genfast's instructions
            tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
            if not tokenizer.template_takes_tools:
                messages, tools = with_tool_instructions(messages, [t["function"] for t in tools]), None
        try:
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools))
        except UserError as e:
            raise APIError(400, str(e), param="messages") from e
        max_tokens = body.max_completion_tokens or body.max_tokens or max(engine.max_seq_len - len(ids), 1)
        tool_names = body.function_names() if body.tools_active else None
        header = ResponseHeader("chat", model_name, tool_names, harmony=tokenizer.harmony)
        return await serve(engine, body, ids, max_tokens, header, request)

    def check_model(body: GenerationBody) -> None:
        if body.model != model_name:
            raise APIError(
                404,
                f"model {body.model!r} does not exist; this server serves {model_name!r}",
                code="model_not_found",
                param="model",
            )

    async def serve(
        engine: Engine, body: GenerationBody, ids: list[int], max_tokens: int, header: ResponseHeader, request: Request
    ) -> JSONResponse | StreamingResponse:
        check_model(body)
        params = SamplingParams(body.temperature, top_p=body.top_p)
        gen = GenerationRequest(
            tuple(ids), max_tokens, params, body.stop_strings, body.seed, body.top_logprobs_requested, body.grammar()
        )
        bridge = _Bridge(only_final=not body.stream)
        try:
            ticket = engine.submit(gen, bridge)
        except UserError as e:
            raise APIError(400, str(e)) from e
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_exceeded", code="queue_full") from e
        except EngineStopped as e:
            raise APIError(503, str(e), "server_error", code="shutting_down") from e
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                _sse(ticket, bridge, header, include_usage, gen.logprobs is not None),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        finished = await _wait(ticket, bridge, request)
        if finished.finish_reason == "error":
            raise APIError(500, f"generation failed: {finished.error}", "server_error")
        return JSONResponse(header.response(finished))

    return app


def serve_engine(app: FastAPI, engine: Engine) -> None:
    """From now on `app` (`create_app`'s) serves `engine`, started and warmed up: the end of its
    "loading" answers."""
    engine.observer = app.state.metrics
    app.state.engine = engine


async def _wait(ticket: Ticket, bridge: _Bridge, request: Request) -> Finished:
    """The request's result; cancels it if the client goes away first (checked every 0.5 s)."""
    get = asyncio.ensure_future(bridge.queue.get())  # the bridge passes only Finished
    try:
        while not get.done():
            await asyncio.wait({get}, timeout=DISCONNECT_POLL_S)
            if not get.done() and await request.is_disconnected():
                ticket.cancel()
    finally:
        if not get.done():  # the handler itself was cancelled (server shutting down)
            get.cancel()
            ticket.cancel()
    return get.result()


async def _sse(
    ticket: Ticket, bridge: _Bridge, header: ResponseHeader, include_usage: bool, logprobs: bool
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per text delta, a last chunk with the finish reason, [DONE].

    When the client disconnects, Starlette cancels this generator: `finally` cancels the request.
    """
    held = header.tool_names is not None  # a reply that may be a tool call is sent whole at its end
    held_logprobs: list[TokenLogprob] = []
    try:
        first = True
        if header.kind == "chat":  # OpenAI announces the role first
            yield _event(header.chunk("", first=True))
            first = False
        while True:
            event = await bridge.queue.get()
            if isinstance(event, Delta):
                if held:
                    held_logprobs.extend(event.logprobs)
                    continue
                yield _event(header.chunk(event.text, first=first, logprobs=event.logprobs if logprobs else None))
                first = False
                continue
            if event.finish_reason == "error":
                yield _event(APIError(500, f"generation failed: {event.error}", "server_error").body())
            elif held:
                for chunk in header.held_reply_chunks(event, held_logprobs if logprobs else None):
                    yield _event(chunk)
            else:
                yield _event(header.chunk(None, event.finish_reason))
                if include_usage:
                    yield _event(header.usage_chunk(event))
            yield "data: [DONE]\n\n"
            return
    finally:
        ticket.cancel()  # no-op once finished


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _validation_error(e: RequestValidationError) -> APIError:
    """One readable sentence from pydantic's errors, e.g. 'max_tokens: Input should be greater
    than or equal to 1'."""
    messages, param = [], None
    for err in e.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return APIError(
                400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}".rstrip(": ")
            )
        field = ".".join(loc)
        param = param or field or None
        messages.append(f"{field}: {err.get('msg')}" if field else str(err.get("msg")))
    return APIError(400, "; ".join(messages) or "invalid request", param=param)
