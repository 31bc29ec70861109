"""Tool calls (`tools`, `tool_choice`) through the official client against a real server, and the
parsing of calls out of replies."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from genfast.serve.tools import parse_tool_calls

pytest.importorskip("llguidance")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in (WEATHER, TIME) if t["function"]["name"] == name)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_required_call_returns_parseable_arguments_that_follow_the_schema(smollm2_server, choice):
    client = smollm2_server.client()
    reply = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0.7, seed=3,
        max_tokens=120,
    )  # fmt: skip
    choice_out = reply.choices[0]
    assert choice_out.finish_reason == "tool_calls" and choice_out.message.content is None
    (call,) = choice_out.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


def test_a_streamed_call_arrives_in_openais_delta_shape(smollm2_server):
    client = smollm2_server.client()
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required", stream=True, max_tokens=120
    )
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), schema_of("get_weather"))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_a_conversation_with_a_call_and_its_result_renders_and_answers(smollm2_server):
    client = smollm2_server.client()
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}  # fmt: skip
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    reply = client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.content


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
            r"tools\[0\].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(serve, kwargs, message):
    client = serve(max_batch=1).client()
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], **kwargs)


def test_a_forced_call_is_refused_for_a_harmony_model(serve):
    server = serve(max_batch=1)
    server.engine.tokenizer.harmony = True  # what a gpt-oss vocabulary sets (tests/llm/test_harmony.py)
    with pytest.raises(openai.BadRequestError, match="not supported for harmony models"):
        server.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w1"}], tools=[WEATHER], tool_choice="required"
        )


def test_tool_messages_need_the_call_they_answer(serve):
    client = serve(max_batch=1).client()
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model="tiny", messages=[{"role": "tool", "content": "w1"}])


NAMES = {"get_weather", "get_time"}


@pytest.mark.parametrize(
    "text,content,calls",
    [
        ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', None,
         [("get_time", {"zone": "UTC"})]),
        ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
         '</tool_call><tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>',
         "Let me check.", [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "CET"})]),
        ('{"name": "get_time", "parameters": {"zone": "PST"}}', None, [("get_time", {"zone": "PST"})]),
        ('{"name": "launch", "arguments": {}}', '{"name": "launch", "arguments": {}}', []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ("It is sunny.", "It is sunny.", []),
    ],
)  # fmt: skip
def test_calls_are_parsed_from_hermes_tags_or_a_bare_call_object(text, content, calls):
    got_content, got = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
