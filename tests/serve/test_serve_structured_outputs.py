"""Structured outputs through `berth serve`, with the official `openai` client: OpenAI's
`response_format` (the SDK's `parse` with a pydantic model, json_schema, json_object) and vLLM's
fields, streamed and not; what cannot constrain an output is a 400 naming the field and why.

The shared server runs the tiny model with random weights: the grammar, not the model, makes
the answers valid."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.serve.server_process import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "coastal": {"type": "boolean"},
    },
    "required": ["name", "population", "coastal"],
    "additionalProperties": False,
}


JSON_OBJECT = {"type": "json_object"}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=99999)
    coastal: bool


def test_the_sdks_parse_returns_the_pydantic_model(client) -> None:
    completion = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=MESSAGES,
        response_format=City,
        max_completion_tokens=120,
        temperature=0.8,
        seed=1,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City)


def test_json_schema_holds_for_every_choice_streamed_or_not(client) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True},
    }
    whole = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        response_format=response_format,
        n=4,
        max_tokens=120,
        temperature=1.2,
        seed=2,
    )
    texts = [c.message.content for c in whole.choices if c.finish_reason == "stop"]
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        response_format=response_format,
        max_tokens=120,
        temperature=1.2,
        seed=3,
        stream=True,
    )
    streamed, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            streamed += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    texts.append(streamed)
    assert len(texts) >= 4
    for text in texts:
        jsonschema.validate(json.loads(text), CITY_SCHEMA)


def test_json_object_gives_an_object(client) -> None:
    completion = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        n=4,
        max_tokens=200,
        seed=4,
    )
    stopped = [c.message.content for c in completion.choices if c.finish_reason == "stop"]
    assert stopped
    assert all(isinstance(json.loads(text), dict) for text in stopped)


@pytest.mark.parametrize(
    ("extra", "valid"),
    [
        ({"guided_choice": ["alpha", "beta"]}, {"alpha", "beta"}.__contains__),
        ({"guided_regex": r"[A-Z]{2}[0-9]{2}"}, re.compile(r"[A-Z]{2}[0-9]{2}").fullmatch),
        ({"guided_json": {"type": "array", "items": DIGIT, "maxItems": 3}},
         lambda text: all(0 <= x <= 9 for x in json.loads(text))),
        ({"structured_outputs": {"grammar": 'start: "go " DIR\nDIR: "north" | "south"'}},
         {"go north", "go south"}.__contains__),
    ],
)  # fmt: skip
def test_vllms_fields_constrain_completions(client, extra, valid) -> None:
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Answer:", n=3, max_tokens=40, temperature=1.0, seed=5, extra_body=extra
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.text
        assert valid(choice.text), choice.text


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
         "response_format", "Unimplemented keys"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"guided_regex": "[a-"}, "guided_regex", "unclosed character class"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "unknown name"),
        ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "no field 'jsonn'"),
        ({"response_format": JSON_OBJECT, "guided_regex": "a"}, "guided_regex", "one structured output"),
        ({"response_format": JSON_OBJECT, "stop": ["}"]}, "structured_outputs", "cannot be combined"),
    ],
)  # fmt: skip
def test_what_cannot_constrain_the_output_is_a_400_naming_the_field(client, fields, param, says) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, extra_body=fields)
    error = caught.value.body
    assert error["param"] == param, error
    assert says in error["message"], error


def test_a_text_response_format_changes_nothing(client) -> None:
    plain, text = (
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0, **extra
        )
        .choices[0]
        .message.content
        for extra in ({}, {"response_format": {"type": "text"}})
    )
    assert plain == text
