"""Every error a client can cause comes back in OpenAI's body shape with the right status,
naming the parameter at fault; never a 500 for bad input."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.serve.server_process import MAX_MODEL_LEN, MAX_REQUEST_BODY_BYTES, MODEL_NAME

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
        # Accepted by the schema, not implemented: echo's prompt logprobs, suffix, best_of.
        (COMPLETIONS, {"echo": True, "logprobs": 1}, "echo"),
        (COMPLETIONS, {"suffix": "the end"}, "suffix"),
        (COMPLETIONS, {"best_of": 2}, "best_of"),
        (COMPLETIONS, {"presence_penalty": 2.5}, "presence_penalty"),
        (COMPLETIONS, {"frequency_penalty": -3}, "frequency_penalty"),
        (COMPLETIONS, {"repetition_penalty": 0}, "repetition_penalty"),
        (COMPLETIONS, {"repetition_penalty": 1000}, "repetition_penalty"),
        (COMPLETIONS, {"min_p": 1.5}, "min_p"),
        (COMPLETIONS, {"min_tokens": -1}, "min_tokens"),
        (COMPLETIONS, {"min_tokens": 5}, "min_tokens"),  # past max_tokens (4)
        (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias"),
        (COMPLETIONS, {"logit_bias": {"five": 1}}, "logit_bias"),
        (COMPLETIONS, {"logit_bias": {"-5": 1}}, "logit_bias"),
        (COMPLETIONS, {"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),  # over 300
        (COMPLETIONS, {"logit_bias": {"512": 1}}, "logit_bias"),  # past the vocabulary (512)
        (COMPLETIONS, {"logit_bias": {str(2**40): 1}}, "logit_bias"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        (CHAT, {"temperature": -1}, "temperature"),
        (CHAT, {"top_logprobs": 3}, "top_logprobs"),  # without logprobs=true
        (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools[0]"),
        (CHAT, {"tool_choice": "required"}, "tool_choice"),  # without tools
        (CHAT, {"logit_bias": {"100000": 1}}, "logit_bias"),
        (CHAT, {"presence_penalty": -2.5}, "presence_penalty"),
        (CHAT, {"max_completion_tokens": 3, "min_tokens": 4}, "min_tokens"),
        (CHAT, {"max_tokens": None, "min_tokens": MAX_MODEL_LEN}, "min_tokens"),  # past what is left
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


def post_raw(server, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    """A body exactly as given (httpx's `json=` cannot carry a lone surrogate)."""
    headers = {"content-type": "application/json", **server.headers(), **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=30)


def post_json(server, path: str, body: dict) -> httpx.Response:
    return post_raw(server, path, json.dumps(body).encode())  # ensure_ascii: "\\ud800" stays an escape


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "is empty"),
        (b'{"prompt": "hi",', "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"null", "must be a JSON object"),
        (b'"hi"', "must be a JSON object"),
    ],
)
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_body_that_is_not_a_json_object_is_a_400_saying_so(server, path, body, says):
    error = error_of(post_raw(server, path, body), 400)
    assert says in error["message"] and error["param"] is None, error


def test_authentication_comes_before_reading_the_body(server):
    """A client without the key learns nothing about its body: 401, not 400 or 413."""
    for body in (b"{not json", b'{"prompt": []}'):
        response = httpx.post(
            server.url + COMPLETIONS, content=body, headers={"content-type": "application/json"}, timeout=10
        )
        assert error_of(response, 401)["code"] == "invalid_api_key"
    oversized = httpx.post(server.url + COMPLETIONS, content=b"x" * (5 << 20), timeout=30)
    assert error_of(oversized, 401)["code"] == "invalid_api_key"


SURROGATE = "\ud800"


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS, {"model": SURROGATE}, "model"),
        (COMPLETIONS, {"prompt": f"hi {SURROGATE}"}, "prompt"),
        (COMPLETIONS, {"prompt": ["ok", "\udfff"]}, "prompt"),
        (COMPLETIONS, {"stop": [SURROGATE]}, "stop"),
        (COMPLETIONS, {"user": SURROGATE}, "user"),
        (COMPLETIONS, {"cache_salt": SURROGATE}, "cache_salt"),
        (COMPLETIONS, {"suffix": SURROGATE}, "suffix"),
        (COMPLETIONS, {"logit_bias": {SURROGATE: 1.0}}, "logit_bias"),
        (CHAT, {"model": SURROGATE}, "model"),
        (CHAT, {"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
            "messages",
        ),
        (CHAT, {"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]}, "messages"),
        (CHAT, {"response_format": {"type": SURROGATE}}, "response_format"),
    ],
)
def test_a_string_with_a_lone_surrogate_is_a_400_naming_it(server, path, fields, param):
    """Defect 9: such strings once ended in a 500 quoting the internal exception."""
    body = {
        "max_tokens": 2,
        **({"prompt": "hi"} if path == COMPLETIONS else {"messages": MESSAGES}),
        **fields,
    }
    error = error_of(post_json(server, path, body), 400)
    assert error["param"] == param and "surrogate" in error["message"], error
    assert "Error" not in error["message"], error  # no internal exception text


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"prompt": [True, False]}, "valid integer"),  # JSON booleans are not token ids
        ({"prompt": [5, -1]}, "prompt[1]: Input should be greater than or equal to 0"),
        ({"prompt": [[5], [6, 2**40]]}, "prompt[1][1]: Input should be less than or equal to"),
        ({"prompt": 5}, "a string, a list of strings, a list of token ids"),
        ({"top_k": 2**64}, "top_k"),
        ({"seed": -(2**64)}, "seed"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ],
)
def test_a_token_id_or_integer_the_engine_cannot_hold_is_a_400_naming_it(server, fields, says):
    """Defect 13 and 8: booleans as token ids, clear messages for bad ids, integers bounded."""
    error = error_of(post_json(server, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, **fields}), 400)
    assert says in error["message"] and error["param"] == next(iter(fields)), error
    assert "constrained-str" not in error["message"], error


def test_a_body_over_the_limit_is_a_413_and_the_server_goes_on(server):
    """Defect 12: the body is bounded (--max-request-body-bytes) before anything reads it."""
    huge = json.dumps({"prompt": "w" * MAX_REQUEST_BODY_BYTES, "max_tokens": 1}).encode()
    error = error_of(post_raw(server, COMPLETIONS, huge), 413)
    assert (
        error["code"] == "request_too_large"
        and f"limit of {MAX_REQUEST_BODY_BYTES} bytes" in error["message"]
    )

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"word " * (1 << 18)
        yield b'"}'

    chunked = httpx.post(
        server.url + COMPLETIONS,
        content=chunks(),
        headers={"content-type": "application/json", **server.headers()},
        timeout=30,
    )
    assert error_of(chunked, 413)["code"] == "request_too_large"
    assert server.get("/health").status_code == 200


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """Defect 12: while a 3 MB prompt is tokenized, the liveness probe still answers at once."""
    text = "the quick brown fox jumps over the lazy dog " * 70_000
    outcome: dict = {}

    def complete() -> None:
        outcome["response"] = post_json(server, COMPLETIONS, {"prompt": text, "max_tokens": 1})
        outcome["done_at"] = time.monotonic()

    worker = threading.Thread(target=complete, daemon=True)
    sent_at = time.monotonic()
    worker.start()
    probes = []
    with httpx.Client(base_url=server.url, timeout=10) as probe:
        while worker.is_alive() and len(probes) < 500:
            started = time.monotonic()
            assert probe.get("/live").status_code == 200
            probes.append((started, time.monotonic() - started))
            time.sleep(0.02)
    worker.join(60)
    error = error_of(outcome["response"], 400)
    assert error["code"] == "context_length_exceeded"  # tokenized, then refused: far too long
    during = [seconds for started, seconds in probes if started < outcome["done_at"]]
    assert len(during) >= 3, "the prompt was tokenized too fast to tell: make it longer"
    # On the event loop, one probe would wait for the whole tokenization; off it, every probe is
    # a small part of it (relative, so a loaded machine slows both sides alike).
    assert max(during) < 0.5 * (outcome["done_at"] - sent_at), probes


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
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", COMPLETIONS),
        ("POST", CHAT),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ],
)
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
