"""`POST /v1/responses` (OpenAI's Responses API, stateless) through `berth serve`, with the
official `openai` client: the same answers as chat for the same messages, `text.format`
structured outputs (the SDK's `responses.parse`), function tools and their loop, the named
event stream (and the SDK's stream helper), `incomplete` at `max_output_tokens`, and a 400
naming the parameter for what this server cannot serve.

The shared server (tiny random-weight model, 256 tokens) serves what fits it; the tool tests
run on one server of their own with a longer context (the tools' system prompt alone takes a
few hundred tokens), as in test_serve_tool_calls.py, and `--reasoning-parser deepseek_r1`: an
unconstrained answer is then all thinking (the random model never writes `</think>`), which
comes as a `reasoning` item; a forced call is constrained, so none is split from it."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.serve.server_process import (
    API_KEY,
    CLIENT_TIMEOUT,
    ENGINE_ARGS,
    MODEL_NAME,
    keyed_server,
    long_context_copy,
)
from tests.serve.test_serve_tool_calls import WEATHER as CHAT_WEATHER

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
    },
    "required": ["name", "population"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = CHAT_WEATHER["function"]["parameters"]  # the chat tests' tool, flattened
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
}
ASK = "What is the weather in Paris?"


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=99999)


def chat_text(client, messages, max_tokens: int):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=max_tokens, temperature=0
    )
    return completion.choices[0], completion.usage


def test_a_string_input_answers_as_chat_does(client) -> None:
    choice, usage = chat_text(client, [{"role": "user", "content": "Tell me a story."}], 12)
    response = client.responses.create(
        model=MODEL_NAME, input="Tell me a story.", max_output_tokens=12, temperature=0
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL_NAME
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert response.output_text == choice.message.content
    assert message.content[0].annotations == []
    assert (response.status == "incomplete") == (choice.finish_reason == "length")
    assert response.usage.input_tokens == usage.prompt_tokens
    assert response.usage.output_tokens == usage.completion_tokens
    assert response.usage.total_tokens == usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.usage.input_tokens_details.cached_tokens >= 0


def test_instructions_are_a_system_message_and_items_are_messages(client) -> None:
    history = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a color."},
    ]
    choice, _ = chat_text(client, history, 10)
    response = client.responses.create(
        model=MODEL_NAME,
        instructions="Answer briefly.",
        input=[
            {"role": "user", "content": "Hi."},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
        ],
        max_output_tokens=10,
        temperature=0,
        store=True,  # accepted; nothing is stored
    )
    assert response.output_text == choice.message.content
    assert response.instructions == "Answer briefly."


def test_max_output_tokens_leaves_the_response_incomplete(client) -> None:
    choice, _ = chat_text(client, [{"role": "user", "content": "Tell me a story."}], 3)
    assert choice.finish_reason == "length"  # the greedy answer is longer
    response = client.responses.create(
        model=MODEL_NAME, input="Tell me a story.", max_output_tokens=3, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.usage.output_tokens == 3


def test_a_json_schema_text_format_gives_valid_json_and_the_sdks_parse_its_model(client) -> None:
    response = client.responses.create(
        model=MODEL_NAME,
        input="Describe a city as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}},
        max_output_tokens=100,
        temperature=0.8,
        extra_body={"seed": 1},
    )
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), CITY_SCHEMA)
    assert response.text.format.type == "json_schema"

    parsed = client.responses.parse(
        model=MODEL_NAME,
        input="Describe a city as JSON.",
        text_format=City,
        max_output_tokens=100,
        extra_body={"seed": 2},
    )
    assert parsed.status == "completed", parsed.output_text
    assert isinstance(parsed.output_parsed, City)


def runs(kinds: list[str]) -> list[str]:
    """The event kinds in order, each run of one kind (the deltas) as one."""
    return [kind for i, kind in enumerate(kinds) if i == 0 or kind != kinds[i - 1]]


STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def test_a_stream_sends_the_documented_events_in_order(client, server) -> None:
    ask = {"model": MODEL_NAME, "input": "Tell me a story.", "max_output_tokens": 12, "temperature": 0}
    events = list(client.responses.create(**ask, stream=True))
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert deltas  # as many as the engine's updates (a fast engine's may carry several tokens)
    # The kinds in order, each once but the deltas.
    assert runs(kinds) == [*STREAM_ORDER, kinds[-1]]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(deltas)
    assert final.output_text == text == events[-3].part.text
    assert final.output[0].id == events[2].item.id == events[4].item_id
    assert text == client.responses.create(**ask).output_text

    # On the wire: an `event:` line naming each `data:` line's type.
    with httpx.stream(
        "POST", f"{server.url}/v1/responses", json={**ask, "stream": True},
        headers=server.headers(), timeout=CLIENT_TIMEOUT,
    ) as wire:  # fmt: skip
        lines = [line for line in wire.iter_lines() if line]
    assert all(line.startswith(("event: ", "data: ")) for line in lines)
    names, data = lines[0::2], lines[1::2]
    wire_kinds = [json.loads(d.removeprefix("data: "))["type"] for d in data]
    assert wire_kinds == [n.removeprefix("event: ") for n in names]
    assert runs(wire_kinds) == runs(kinds)  # the deltas as the engine's updates came, this time

    # The SDK's helper (which wants the stream to end `response.completed`: a schema ends it).
    with client.responses.stream(
        model=MODEL_NAME, input="Describe a city as JSON.", text_format=City, max_output_tokens=100,
        extra_body={"seed": 3},
    ) as helper:  # fmt: skip
        deltas = [event.delta for event in helper if event.type == "response.output_text.delta"]
        streamed = helper.get_final_response()
    assert streamed.status == "completed" and streamed.output_text == "".join(deltas)
    assert isinstance(streamed.output_parsed, City)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "stateless"),
        ({"conversation": "conv_1"}, "conversation", "stateless"),
        ({"background": True}, "background", "stateless"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name", "flat"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"not": {}}}]},
         "tools[0].parameters", "cannot constrain"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "tool_choice must be"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
        ({"truncation": "auto"}, "truncation", "truncation"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "not": {}}}}},
         "text.format", "text.format cannot constrain"),
        ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
         "tool_choice", "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"max_output_tokens": 5000}, "max_output_tokens", "maximum context length"),
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "empty"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type", "input_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]", "text"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
         "input[0].arguments", "not JSON"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "call_id"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "role"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_parameter(server, fields, param, says) -> None:
    answer = server.post("/v1/responses", {"model": MODEL_NAME, "input": "Hi", **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    assert says in error["message"], error


# ---- tools, on a server of their own ----------------------------------------------------------


@pytest.fixture(scope="module")
def tool_client(tiny_model, tmp_path_factory):
    model = long_context_copy(tiny_model, tmp_path_factory.mktemp("responses-tools-model"), 2048)
    server = keyed_server(
        model, *ENGINE_ARGS, "--served-model-name", MODEL_NAME, "--reasoning-parser", "deepseek_r1"
    )
    try:
        with openai.OpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, timeout=CLIENT_TIMEOUT, max_retries=0
        ) as sync_client:
            yield sync_client
    finally:
        assert server.stop() == 0, server.output


def test_a_required_tool_gives_a_function_call_and_the_loop_runs(tool_client) -> None:
    first = tool_client.responses.create(
        model=MODEL_NAME, input=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=200, extra_body={"seed": 5},
    )  # fmt: skip
    assert first.status == "completed"
    [call] = first.output  # no message: the answer is the call
    assert call.type == "function_call" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.status == "completed" and call.name in ("get_weather", "get_time")
    jsonschema.validate(
        json.loads(call.arguments), {t["name"]: t["parameters"] for t in (WEATHER, TIME)}[call.name]
    )
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"

    named = tool_client.responses.create(
        model=MODEL_NAME, input=ASK, tools=[WEATHER, TIME], max_output_tokens=200, extra_body={"seed": 6},
        tool_choice={"type": "function", "name": "get_time"},
    )  # fmt: skip
    assert [item.name for item in named.output] == ["get_time"]

    # The tool's result sent back with the call: an answer.
    answer = tool_client.responses.create(
        model=MODEL_NAME,
        input=[
            {"role": "user", "content": ASK},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 21})},
        ],
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_output_tokens=12,
        temperature=0,
    )
    assert answer.output and all(item.type != "function_call" for item in answer.output)
    assert "<tool_call>" not in answer.output_text


def test_a_reasoning_models_thinking_is_a_reasoning_item(tool_client) -> None:
    ask = [{"role": "user", "content": "Think."}]
    chat = tool_client.chat.completions.create(
        model=MODEL_NAME, messages=ask, max_completion_tokens=8, temperature=0
    )
    thinking = chat.choices[0].message.reasoning_content
    assert thinking and chat.choices[0].finish_reason == "length"
    response = tool_client.responses.create(model=MODEL_NAME, input=ask, max_output_tokens=8, temperature=0)
    [reasoning] = response.output  # all thinking: no message
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text == thinking
    assert reasoning.status == "incomplete" and response.status == "incomplete"

    events = list(
        tool_client.responses.create(
            model=MODEL_NAME, input=ask, max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    assert runs(kinds) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert "".join(deltas).strip() == thinking == events[-1].response.output[0].content[0].text.strip()

    # The thinking sent back, as clients do: left out of the prompt.
    again = tool_client.responses.create(
        model=MODEL_NAME, input=[*ask, reasoning.model_dump(), {"role": "user", "content": "Go on."}],
        max_output_tokens=2,
    )  # fmt: skip
    assert again.status == "incomplete"


def test_a_streamed_call_assembles_to_arguments_that_validate(tool_client) -> None:
    ask = {
        "model": MODEL_NAME, "input": ASK, "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False, "max_output_tokens": 200, "extra_body": {"seed": 3},
    }  # fmt: skip
    events = list(tool_client.responses.create(**ask, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"
    ]  # fmt: skip
    assert "response.output_text.delta" not in kinds
    added = events[2].item
    assert added.type == "function_call" and added.name == "get_weather" and added.arguments == ""
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    assert events[-3].arguments == arguments == events[-1].response.output[0].arguments
    assert events[-1].response.output[0].call_id == added.call_id

    with tool_client.responses.stream(**ask) as helper:
        final = helper.get_final_response()
    assert [item.type for item in final.output] == ["function_call"]
    assert final.output[0].arguments == arguments
