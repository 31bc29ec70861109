"""The OpenAI HTTP API's request and response bodies (the subset genfast serves) and its errors.

Requests are validated strictly: an unknown field, a wrong type or a value out of range is a 400
with a message naming the field, never silently ignored. OpenAI fields genfast does not implement
(penalties, logit_bias, ...) are accepted only at their neutral value, so a client that sends
defaults keeps working and one that relies on them learns it at once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from genfast.errors import UserError
from genfast.llm.harmony import ANALYSIS, FINAL, HarmonyStream, parse_messages, split_reply
from genfast.serve.constraints import json_schema_grammar, response_format_grammar
from genfast.serve.engine import MAX_SEED, MAX_TOP_LOGPROBS, MIN_SEED, Finished, TokenLogprob
from genfast.serve.tools import ToolCall, call_grammar, harmony_tool_calls, parse_tool_calls

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
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
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

    def grammar(self) -> str | None:
        """The grammar the reply must follow (genfast.serve.constraints); None: free text."""
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


class FunctionSpec(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted; arguments follow the schema when the call is constrained


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer: to which call

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (templates know "system"; OpenAI's newer
        "developer" means the same; calls' arguments as objects, which templates serialize)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _json(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json(call: MessageToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


class ChatCompletionRequest(GenerationBody):
    """POST /v1/chat/completions; the model's own chat template renders `messages`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted: an unconstrained reply may hold several calls
    response_format: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tools_compile(cls, tools: list[ToolSpec] | None) -> list[ToolSpec] | None:
        names = [t.function.name for t in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        for i, tool in enumerate(tools or ()):
            if tool.function.parameters is not None:
                try:
                    json_schema_grammar(tool.function.parameters, f"tools[{i}].function.parameters")
                except UserError as e:  # llguidance is missing
                    raise ValueError(str(e)) from None
        return tools

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.function_names():
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        if self.forced_call and response_format_grammar(self.response_format) is not None:
            raise ValueError("response_format cannot be combined with a required tool call (tool_choice)")
        return self

    def function_names(self) -> set[str]:
        return {t.function.name for t in self.tools or ()}

    @property
    def tools_active(self) -> bool:
        """The model is offered tools (tool_choice is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_call(self) -> bool:
        """The reply must be a call (tool_choice "required" or a named function)."""
        return self.tools_active and self.tool_choice not in (None, "auto")

    @field_validator("response_format")
    @classmethod
    def _response_format_compiles(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            response_format_grammar(value)
        except UserError as e:  # llguidance is missing
            raise ValueError(str(e)) from None
        return value

    def grammar(self) -> str | None:
        if self.forced_call:
            functions = [t.function.model_dump(exclude_none=True) for t in self.tools or ()]
            named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
            return call_grammar(functions, named)
        return response_format_grammar(self.response_format)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_logprobs_requested(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


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

    def __init__(
        self,
        kind: Literal["completion", "chat"],
        model: str,
        tool_names: set[str] | None = None,
        harmony: bool = False,
    ) -> None:
        """`tool_names`: the functions a chat reply may call (its calls are parsed into tool_calls;
        streamed, the reply is then sent whole at its end). `harmony`: the model's replies are in
        OpenAI's harmony format (gpt-oss; genfast.llm.harmony): a chat reply's content is its final
        channel, its analysis goes to `reasoning_content`."""
        self.kind, self.model, self.tool_names = kind, model, tool_names
        self._harmony = HarmonyStream() if harmony and kind == "chat" else None
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
        content, calls = self._calls(finished)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self._harmony is not None and ANALYSIS in (channels := split_reply(finished.text)):
            message["reasoning_content"] = channels[ANALYSIS]
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
            reason = "tool_calls"
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
        return self._object("chat.completion", [choice], Usage.of(finished))

    def _calls(self, finished: Finished) -> tuple[str | None, list[ToolCall]]:
        if self._harmony is not None:
            messages = parse_messages(finished.text)
            content = "".join(m.text for m in messages if m.channel == FINAL and m.recipient is None)
            calls = harmony_tool_calls(messages, self.tool_names or set()) if finished.finish_reason == "stop" else []
            return (content or None, calls) if calls else (content, [])
        if not self.tool_names or finished.finish_reason != "stop":
            return finished.text, []
        return parse_tool_calls(finished.text, self.tool_names)

    def held_reply_chunks(self, finished: Finished, logprobs: Sequence[TokenLogprob] | None) -> list[dict[str, Any]]:
        """A reply that was held back while streaming (tools offered): its content or its calls
        as one chunk, then the chunk with the finish reason."""
        content, calls = self._calls(finished)
        if calls:
            delta: dict[str, Any] = {"tool_calls": [c.as_openai(index=i) for i, c in enumerate(calls)]}
            if self._harmony is not None and ANALYSIS in (channels := split_reply(finished.text)):
                delta["reasoning_content"] = channels[ANALYSIS]
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            last = self.chunk(None, finished.finish_reason)
            last["choices"][0]["finish_reason"] = "tool_calls"
            return [self._object("chat.completion.chunk", [choice], None), last]
        # A harmony reply goes through its stream parser whole: content and reasoning apart.
        text = finished.text if self._harmony is not None else content
        return [self.chunk(text, logprobs=logprobs), self.chunk(None, finished.finish_reason)]

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
        if self._harmony is not None:
            delta = self._harmony_delta(text)
        else:
            delta = {} if text is None else {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs), "finish_reason": reason}
        return self._object("chat.completion.chunk", [choice], None)

    def _harmony_delta(self, text: str | None) -> dict[str, Any]:
        """A streamed harmony reply's new text as content (final channel) and reasoning_content
        (analysis); None: the reply ended, flush what was held back."""
        assert self._harmony is not None
        pieces = self._harmony.finish() if text is None else self._harmony.push(text)
        delta: dict[str, Any] = {}
        for key, channel in (("content", FINAL), ("reasoning_content", ANALYSIS)):
            part = "".join(t for c, t in pieces if c == channel)
            if part:
                delta[key] = part
        if text is not None and not delta:
            delta["content"] = ""  # a chunk per delta, as for other models
        return delta

    def usage_chunk(self, finished: Finished) -> dict[str, Any]:
        """The extra last chunk sent with stream_options.include_usage (no choices, as OpenAI)."""
        return self._object(
            "text_completion" if self.kind == "completion" else "chat.completion.chunk", [], Usage.of(finished)
        )
