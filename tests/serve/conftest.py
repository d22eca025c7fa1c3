"""`berth serve` tests drive real server processes over HTTP.

One server is shared by the whole folder (each start costs seconds): it runs with an API key
and an admin token taken from the environment, as a deployment passes them. Tests that kill
it or stop it start their own. The reference engine is the same model with the same engine
options, in this process: the server's answers must be the engine's own.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from berth.engine import LLM
from tests.serve.server_process import (
    API_KEY,
    CLIENT_TIMEOUT,
    ENGINE_ARGS,
    ENGINE_OPTIONS,
    MAX_MODEL_LEN,
    MAX_REQUEST_BODY_BYTES,
    MODEL_NAME,
    ServerProcess,
    keyed_server,
)


@pytest.fixture(scope="session")
def server(tiny_model: Path):
    process = keyed_server(
        tiny_model,
        *ENGINE_ARGS,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--served-model-name", MODEL_NAME,
        "--max-request-body-bytes", str(MAX_REQUEST_BODY_BYTES),
    )  # fmt: skip
    yield process
    assert process.stop() == 0, process.output


@pytest.fixture(scope="session")
def reference(tiny_model: Path):
    """The engine itself, in this process, configured as the server's."""
    with LLM(tiny_model, executor="in-process", max_model_len=MAX_MODEL_LEN, **ENGINE_OPTIONS) as llm:
        yield llm


@pytest.fixture
def client(server: ServerProcess):
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=API_KEY, timeout=CLIENT_TIMEOUT, max_retries=0
    ) as sync_client:
        yield sync_client


@pytest.fixture
async def async_client(server: ServerProcess):
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=API_KEY, timeout=CLIENT_TIMEOUT, max_retries=0
    ) as client:
        yield client
