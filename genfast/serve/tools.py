"""Tool calls: OpenAI's `tools` and `tool_choice` rendered into the prompt, and the reply's calls
parsed back into `tool_calls`.

Rendering: a chat template that takes a `tools` variable (Qwen, Llama 3.1+, Hermes-style ones)
renders the definitions its model was trained on; for one that does not, the definitions and
the calling convention below go into the system message.

The reply: a call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes form
Qwen and SmolLM3 are trained on; several in one reply are several calls) or a reply that is
nothing but such a JSON object (Llama 3.1's form, "parameters" for "arguments"). A harmony model
(gpt-oss) addresses a message `to=functions.NAME` instead, its text the arguments
(`harmony_tool_calls`). With
`tool_choice` "required" or a named function the reply is constrained to that JSON object (one
call; `arguments` following the function's parameter schema), so it always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from genfast.llm.harmony import Message
from genfast.serve.constraints import json_schema_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def instructions(functions: list[dict[str, Any]]) -> str:
    """The system-message text for a chat template that does not render tools itself."""
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return (
        "You can call functions. Their definitions:\n"
        f"{listing}\n"
        f'To call a function, reply with {OPEN}{{"name": <function name>, "arguments": <arguments as a JSON '
        f"object>}}{CLOSE} and nothing else."
    )


def with_tool_instructions(messages: list[dict[str, Any]], functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the tool instructions in the system message (added if there is none)."""
    text = instructions(functions)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def call_grammar(functions: list[dict[str, Any]], name: str | None) -> str:
    """A grammar for exactly one call: of function `name`, or of any of `functions` (required)."""

    def call_schema(function: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                "arguments": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    chosen = [f for f in functions if name is None or f["name"] == name]
    schema = call_schema(chosen[0]) if len(chosen) == 1 else {"anyOf": [call_schema(f) for f in chosen]}
    return json_schema_grammar(schema, "tools")


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply: the text outside the calls (None when nothing is left) and
    the calls of known functions with JSON-object arguments. A reply with no such call is all
    content."""
    calls = []
    for block in _BLOCK.findall(text):
        call = _call(block, names)
        if call is None:
            return text, []  # a malformed call: leave the reply as text rather than guess
        calls.append(call)
    if calls:
        rest = _BLOCK.sub("", text).strip()
        return rest or None, calls
    whole = _call(text, names)
    return (None, [whole]) if whole is not None else (text, [])


def harmony_tool_calls(messages: list[Message], names: set[str]) -> list[ToolCall] | None:
    """The calls of a harmony reply's messages: those addressed `to=functions.NAME` of a known
    function, with a JSON object as their text. None where such a message is malformed (an
    unknown function, arguments that are not a JSON object): the reply is then left as text."""
    calls = []
    for message in messages:
        if message.recipient is None or not message.recipient.startswith("functions."):
            continue
        call = _known_call(message.recipient.removeprefix("functions."), message.text, names)
        if call is None:
            return None
        calls.append(call)
    return calls


def _call(candidate: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(candidate)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    return _known_call(value.get("name"), value.get("arguments", value.get("parameters", {})), names)


def _known_call(name: Any, arguments: Any, names: set[str]) -> ToolCall | None:
    """A call of function `name` (one of `names`) with `arguments`: a dict, or its JSON text (some
    models write the arguments as a JSON string)."""
    if name not in names:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")
