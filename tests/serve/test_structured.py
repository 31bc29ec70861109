"""Structured output (`response_format`) through the official client against a real server:
every json_schema reply validates (checked by jsonschema, not by the grammar library that
constrained it), with sampling at temperature 0.7; bad formats are 400s naming the field.

The schemas bound their strings, arrays and numbers, as schemas for a 135M model should: the
grammar guarantees the form, not that a small model stops writing digits (unbounded, SmolLM2
wrote a 90-digit zip code)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytest.importorskip("llguidance")

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enum-and-boolean": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["color", "bright"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "fruits": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4}
        },
        "required": ["fruits"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "height": {"type": "number", "minimum": 0.5, "maximum": 2.5},
            "scores": {"type": "array", "items": {"type": "number", "minimum": -10, "maximum": 10}, "maxItems": 3},
        },
        "required": ["age", "height", "scores"],
        "additionalProperties": False,
    },
}


def ask(client, content: str, response_format: dict, seed: int, max_tokens: int = 120):
    return client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": content}],
        response_format=response_format,
        temperature=0.7,
        seed=seed,
        max_tokens=max_tokens,
    )


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_replies_validate_when_sampling(smollm2_server, name):
    from concurrent.futures import ThreadPoolExecutor

    client = smollm2_server.client()
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    prompt = f"Reply with a JSON object for this schema: {json.dumps(schema)}"
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda seed: ask(client, prompt, fmt, seed), range(4)))
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_json_object_replies_parse_as_objects_streamed_too(smollm2_server):
    client = smollm2_server.client()
    reply = ask(client, "Reply with a JSON object holding a city and its country.", {"type": "json_object"}, 1, 300)
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Reply with a JSON object holding a city and its country."}],
        response_format={"type": "json_object"},
        stream=True,
        temperature=0.7,
        seed=1,
        max_tokens=300,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "response_format,message",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, "objekt"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema must be a JSON object"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "text", "schema": {}}, "no other fields"),
    ],
)
def test_bad_response_formats_are_400s_naming_the_field(serve, response_format, message):
    client = serve(max_batch=1).client()
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w1"}], response_format=response_format
        )
    assert "response_format" in str(caught.value)


def test_a_tokenizer_the_grammar_engine_cannot_read_is_a_400(serve):
    """The tiny model's word tokenizer (WordPiece decoding) has no byte form for llguidance."""
    client = serve(max_batch=1).client()
    with pytest.raises(openai.BadRequestError, match="cannot use this model's tokenizer"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w1"}], response_format={"type": "json_object"}
        )
