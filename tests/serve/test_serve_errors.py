"""Every error a client can cause comes back in OpenAI's body shape with the right status,
naming the parameter at fault; never a 500 for bad input."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.server_process import MAX_MODEL_LEN, MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello"}]


def error_of(response: httpx.Response, status: int) -> dict:
    """The response's error object, after checking the status and OpenAI's exact shape."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS, {"temperature": 5}, "temperature"),
        (COMPLETIONS, {"n": 0}, "n"),
        (COMPLETIONS, {"top_p": 0}, "top_p"),
        (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"seed": 2**64}, "seed"),
        (COMPLETIONS, {"stop": [""]}, "stop"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": [5, -1]}, "prompt"),
        (COMPLETIONS, {"prompt": [10**6]}, "prompt"),  # outside the vocabulary
        (COMPLETIONS, {"n": 17}, "n"),  # more choices than the engine's batch
        (COMPLETIONS, {"echo": True}, "echo"),  # accepted by the schema, not implemented
        (COMPLETIONS, {"presence_penalty": 1.0}, "presence_penalty"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        (CHAT, {"temperature": -1}, "temperature"),
        (CHAT, {"top_logprobs": 3}, "top_logprobs"),  # without logprobs=true
        (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
)
def test_an_invalid_parameter_is_a_400_naming_it(server, path, fields, param):
    body = {"model": MODEL_NAME, "max_tokens": 4, **({"prompt": "hi"} if path == COMPLETIONS else {})}
    if path == CHAT:
        body["messages"] = MESSAGES
    body.update(fields)
    error = error_of(server.post(path, body), 400)
    assert error["param"] == param, error


def test_the_openai_client_sees_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=5)
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == "temperature"


def test_a_body_that_is_not_json_is_a_400(server):
    response = httpx.post(
        server.url + COMPLETIONS,
        content=b"{not json",
        headers={**server.headers(), "content-type": "application/json"},
        timeout=10,
    )
    error_of(response, 400)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_an_unknown_model_is_a_404(server, path):
    body = (
        {"model": "gpt-5", "prompt": "hi"}
        if path == COMPLETIONS
        else {"model": "gpt-5", "messages": MESSAGES}
    )
    error = error_of(server.post(path, body), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert "gpt-5" in error["message"]


def test_an_unknown_model_card_is_a_404_for_the_openai_client(client):
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")


def test_a_prompt_longer_than_the_model_allows_is_a_400_with_the_numbers(server):
    too_long = [5] * (MAX_MODEL_LEN + 44)
    error = error_of(server.post(COMPLETIONS, {"prompt": too_long, "max_tokens": 4}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert str(MAX_MODEL_LEN) in error["message"] and str(MAX_MODEL_LEN + 44) in error["message"]


def test_a_prompt_and_budget_past_the_models_length_is_a_400_with_the_numbers(server):
    error = error_of(server.post(COMPLETIONS, {"prompt": [5] * 200, "max_tokens": 100}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    for number in (MAX_MODEL_LEN, 300, 200, 100):
        assert str(number) in error["message"], error["message"]


def test_a_chat_longer_than_the_model_allows_is_a_400(server):
    messages = [{"role": "user", "content": "word " * 400}]
    error = error_of(server.post(CHAT, {"messages": messages, "max_completion_tokens": 4}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert str(MAX_MODEL_LEN) in error["message"]


@pytest.mark.parametrize("token", [None, "sk-wrong"])
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", CHAT)])
def test_a_missing_or_wrong_api_key_is_a_401(server, token, method, path):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.request(
        method, server.url + path, json={"prompt": "hi", "messages": MESSAGES}, headers=headers, timeout=10
    )
    error = error_of(response, 401)
    assert error["code"] == "invalid_api_key"


def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", timeout=10, max_retries=0)
    with client, pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_probes_need_no_key_and_admin_needs_its_own_token(server):
    for probe in ("/health", "/ready", "/live", "/metrics"):
        assert httpx.get(server.url + probe, timeout=10).status_code == 200, probe
    assert error_of(server.get("/admin/state", headers={}), 401)["code"] == "invalid_admin_token"
    # The API key is not the admin token.
    assert server.get("/admin/state", headers=server.headers()).status_code == 401
    assert server.get("/admin/state", headers=server.headers(server.admin_token)).status_code == 200


def test_an_unknown_route_is_a_404_and_a_wrong_method_a_405_in_the_same_shape(server):
    error_of(server.get("/v2/nothing"), 404)
    error_of(server.get(COMPLETIONS), 405)
