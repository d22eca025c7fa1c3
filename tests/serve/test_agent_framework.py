"""An agent framework people point at vLLM, pointed at `berth serve` on SmolLM2: LangChain's
`ChatOpenAI` with `bind_tools` runs the two-step tool loop (call -> tool result -> answer), and
`with_structured_output` returns its pydantic model."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.serve.server_process import API_KEY, keyed_server

MODEL = "smollm2"


@tool
def get_weather(city: str) -> str:
    """The weather in a city now."""
    return json.dumps({"city": city, "sky": "sunny", "celsius": 21})


class Capital(BaseModel):
    country: str = Field(max_length=20)
    capital: str = Field(max_length=20)


@pytest.fixture(scope="module")
def chat_model(smollm2):
    server = keyed_server(
        smollm2, "--served-model-name", MODEL, "--max-batch-size", "4", "--kv-blocks", "256"
    )
    try:
        yield ChatOpenAI(
            model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, temperature=0, max_tokens=48,
            timeout=120, max_retries=0,
        )  # fmt: skip
    finally:
        assert server.stop() == 0, server.output


@pytest.mark.slow  # SmolLM2 served and asked four times
def test_langchains_tool_loop_and_structured_output_run_against_berth(chat_model) -> None:
    question = HumanMessage("What is the weather in Paris?")
    call = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    assert isinstance(call, AIMessage) and call.tool_calls, call
    [request] = call.tool_calls
    assert request["name"] == "get_weather" and isinstance(request["args"]["city"], str), request
    result = get_weather.invoke(request)  # the ToolMessage answering that call's id

    answer = chat_model.bind_tools([get_weather]).invoke([question, call, result])
    assert isinstance(answer, AIMessage)
    assert answer.content or answer.tool_calls, answer
    assert "<tool_call>" not in str(answer.content)

    capital = chat_model.with_structured_output(Capital, method="json_schema").invoke(
        "Give the capital of France."
    )
    assert isinstance(capital, Capital), capital
