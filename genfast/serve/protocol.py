"""The OpenAI HTTP API's request and response bodies (the subset genfast serves) and its errors.

Requests are validated strictly: an unknown field, a wrong type or a value out of range is a 400
with a message naming the field, never silently ignored. OpenAI fields genfast does not implement
(penalties, tools, ...) are accepted only at their neutral value, so a client that sends
defaults keeps working and one that relies on them learns it at once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from genfast.serve.engine import MAX_TOP_LOGPROBS, Finished, TokenLogprob

# What genfast reports for "the request was cut short by the server" (OpenAI has no such reason).
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class APIError(Exception):
    """An error answered as OpenAI does: HTTP status + {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


# Fields of OpenAI's API that genfast accepts only at these neutral values.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class GenerationBody(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default: sampling
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None)
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _supported(self) -> GenerationBody:
        for name, allowed in _NEUTRAL.items():
            value = getattr(self, name, None)
            if value not in allowed:
                raise ValueError(f"{name} is not supported by genfast serve (leave it unset)")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop takes at most 4 sequences")
        return self

    @property
    def top_logprobs_requested(self) -> int | None:
        """Alternatives to report per token with log-probabilities; None: no log-probabilities."""
        return None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(GenerationBody):
    """POST /v1/completions. `prompt`: one text or one list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # The sampled token's log-probability and this many alternatives (legacy completions' shape).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise APIError(
                    400, f"prompt holds {len(p)} prompts; genfast serve takes one prompt per request", param="prompt"
                )
            return p[0]
        return p

    @property
    def top_logprobs_requested(self) -> int | None:
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(GenerationBody):
    """POST /v1/chat/completions; the model's own chat template renders `messages`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_logprobs_requested(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        # Templates know "system"; OpenAI's newer "developer" role means the same.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # found in the cache (a reused prefix), not prefilled


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, finished: Finished) -> Usage:
        return cls(
            prompt_tokens=finished.prompt_tokens,
            completion_tokens=finished.completion_tokens,
            total_tokens=finished.prompt_tokens + finished.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=finished.cached_tokens),
        )


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def item(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(*t) for t in e.top]} for e in entries]}


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """Completions' `logprobs`: parallel lists of tokens, their log-probabilities, {token:
    logprob} alternatives and each token's offset in the text (`offset`: where these start)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


class ResponseHeader:
    """The id, creation time and model every response object and stream chunk of one request shares."""

    def __init__(self, kind: Literal["completion", "chat"], model: str) -> None:
        self.kind, self.model = kind, model
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._streamed_chars = 0  # completions' text offsets across stream chunks

    def _logprobs(self, entries: Sequence[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
        if entries is None:
            return None
        return completion_logprobs(entries, offset) if self.kind == "completion" else chat_logprobs(entries)

    def _object(self, object_name: str, choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage.model_dump()
        return body

    def response(self, finished: Finished) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        reason = FINISH_REASONS[finished.finish_reason]
        logprobs = self._logprobs(finished.logprobs)
        if self.kind == "completion":
            choice = {"index": 0, "text": finished.text, "logprobs": logprobs, "finish_reason": reason}
            return self._object("text_completion", [choice], Usage.of(finished))
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": finished.text},
            "logprobs": logprobs,
            "finish_reason": reason,
        }
        return self._object("chat.completion", [choice], Usage.of(finished))

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        first: bool = False,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        """One stream chunk: new text (with its tokens' log-probabilities, if asked for), or the
        final one carrying the finish reason."""
        reason = FINISH_REASONS[finish_reason] if finish_reason else None
        if self.kind == "completion":
            rendered = self._logprobs(logprobs, self._streamed_chars)
            self._streamed_chars += sum(len(e.token) for e in logprobs or ())
            choice = {"index": 0, "text": text or "", "logprobs": rendered, "finish_reason": reason}
            return self._object("text_completion", [choice], None)
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs), "finish_reason": reason}
        return self._object("chat.completion.chunk", [choice], None)

    def usage_chunk(self, finished: Finished) -> dict[str, Any]:
        """The extra last chunk sent with stream_options.include_usage (no choices, as OpenAI)."""
        return self._object(
            "text_completion" if self.kind == "completion" else "chat.completion.chunk", [], Usage.of(finished)
        )
