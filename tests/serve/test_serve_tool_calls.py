"""Tool calls through `berth serve`, with the official `openai` client: forced calls (`required`,
a named function) whose arguments validate, one call or several, streamed in OpenAI's delta shape
and assembled by the SDK's own helpers, a call -> result -> answer loop, and a 400 naming the
field for what cannot be served.

The server runs the tiny model (random weights; its chat template knows nothing of tools, so
they reach it in a system prompt, and earlier calls written in the hermes format), with a
longer context than the shared server's: that prompt alone takes a few hundred of its tokens."""

from __future__ import annotations

import json

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

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory):
    model = long_context_copy(tiny_model, tmp_path_factory.mktemp("tools-model"), 2048)
    server = keyed_server(model, *ENGINE_ARGS, "--served-model-name", MODEL_NAME)
    try:
        with openai.OpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, timeout=CLIENT_TIMEOUT, max_retries=0
        ) as sync_client:
            yield sync_client
    finally:
        assert server.stop() == 0, server.output


def check_calls(message) -> list[str]:
    assert not message.content, message.content  # None; "" from a stream's opening chunk
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [call.function.name for call in message.tool_calls]


def test_required_gives_calls_whose_arguments_validate(client) -> None:
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, n=3, max_tokens=200, temperature=1.0, seed=1,
    )  # fmt: skip
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert len(check_calls(choice.message)) == 1


def test_a_named_function_is_the_one_called(client) -> None:
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], max_tokens=200, n=2, seed=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls"
        assert set(check_calls(choice.message)) == {"get_time"}


def test_streamed_calls_come_in_openais_delta_shape_and_the_sdk_assembles_them(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=3,
        stream=True,
    )
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
            assert not choice.delta.content
    assert finish == "tool_calls"
    head, *rest = deltas
    assert head.index == 0 and head.id.startswith("call_") and head.function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_weather"])

    with client.chat.completions.stream(
        model=MODEL_NAME,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=3,
    ) as helper:
        final = helper.get_final_completion()
    assert check_calls(final.choices[0].message) == ["get_weather"]
    assert final.choices[0].message.tool_calls[0].function.arguments == arguments


class Lookup(BaseModel):
    """Look a word up."""

    word: str = Field(max_length=10)
    limit: int = Field(ge=1, le=5)


def test_the_sdks_pydantic_tools_parse_their_arguments(client) -> None:
    completion = client.chat.completions.parse(
        model=MODEL_NAME, messages=ASK, tools=[openai.pydantic_function_tool(Lookup)], tool_choice="required",
        max_tokens=200, seed=4,
    )  # fmt: skip
    call = completion.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Lookup)


def test_a_call_its_result_and_the_answer(client) -> None:
    """The loop agents run: a forced call, the tool's result sent back, then an answer."""
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=200, seed=5
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21})},
    ]
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=12, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls in (None, [])
    assert "<tool_call>" not in (choice.message.content or "")


def test_auto_never_leaves_call_markup_in_the_content(client) -> None:
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], n=4, max_tokens=40, temperature=1.5, seed=6
    )
    for choice in completion.choices:
        assert "<tool_call>" not in (choice.message.content or "")
        if choice.message.tool_calls:
            check_calls(choice.message)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "one of the tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]", "letters, digits"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", '"type": "function"'),
        ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]},
         "tools[0].function.parameters", "Unimplemented keys"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "response_format"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"},
         "tool_choice", "structured output"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
         "messages", "not JSON"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_field(client, fields, param, says) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=8, extra_body=fields)
    error = caught.value.body
    assert error["param"] == param, error
    assert says in error["message"], error


def test_the_parser_flags_set_the_call_format_and_split_thinking(tiny_model) -> None:
    """`--tool-call-parser pythonic`: a format no grammar forces, so `required` is refused (with
    the template's hermes it is served above). `--reasoning-parser deepseek_r1`: the prompt opens
    the thinking, so an answer that never closes it (random weights) is all reasoning, whole or
    streamed."""
    server = keyed_server(
        tiny_model, *ENGINE_ARGS, "--executor", "in-process",
        "--tool-call-parser", "pythonic", "--reasoning-parser", "deepseek_r1",
    )  # fmt: skip
    try:
        body = {"messages": ASK, "tools": [TIME], "tool_choice": "required", "max_tokens": 8}
        answer = server.post("/v1/chat/completions", body)
        assert answer.status_code == 400 and "pythonic" in answer.json()["error"]["message"], answer.text

        greedy = {"messages": ASK, "max_tokens": 8, "temperature": 0}
        message = server.post("/v1/chat/completions", greedy).json()["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"]
        streamed = server.post("/v1/chat/completions", {**greedy, "stream": True}).text
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"] for line in streamed.splitlines() if "delta" in line
        ]
        assert "".join(d.get("reasoning_content", "") for d in deltas).strip() == message["reasoning_content"]
        assert not any(d.get("content") for d in deltas)
    finally:
        assert server.stop() == 0, server.output
