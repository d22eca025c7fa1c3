"""Fuzzing: schemathesis generates requests from the server's own OpenAPI document, both ones
that fit it (which run the model) and ones that break it. None may get a 5xx, every error comes
in OpenAI's shape, and every status is one the document lists for the operation.

Bounded: a fixed number of examples per operation and mode, no shrinking, no deadline (a request
runs the model) but a timeout on every call. (schemathesis' pytest plugin does not load under
pytest 9, so the strategies are driven by hypothesis directly.)"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.serve.server_process import ServerProcess

POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# (method, path) -> examples per mode. The model-running operations get the most.
OPERATIONS = {
    ("POST", "/v1/completions"): {POSITIVE: 60, NEGATIVE: 30},
    ("POST", "/v1/chat/completions"): {POSITIVE: 60, NEGATIVE: 30},
    ("POST", "/v1/responses"): {POSITIVE: 40, NEGATIVE: 20},
    ("POST", "/tokenize"): {POSITIVE: 20, NEGATIVE: 10},
    ("POST", "/detokenize"): {POSITIVE: 20, NEGATIVE: 10},
    ("GET", "/v1/models"): {POSITIVE: 3},
    ("GET", "/v1/models/{model}"): {POSITIVE: 10},
    ("GET", "/health"): {POSITIVE: 2},
    ("GET", "/ready"): {POSITIVE: 2},
    ("GET", "/live"): {POSITIVE: 2},
    ("GET", "/metrics"): {POSITIVE: 2},
    ("GET", "/admin/state"): {POSITIVE: 2},
    # Bodies that break the schema only: a valid one would put the shared server to sleep (the
    # valid ones are tested in test_serve_sleep.py).
    ("POST", "/admin/sleep"): {NEGATIVE: 20},
    ("POST", "/admin/wakeup"): {NEGATIVE: 10},
}
CASES = [(method, path, mode, n) for (method, path), modes in OPERATIONS.items() for mode, n in modes.items()]


@pytest.fixture(scope="module")
def openapi(server: ServerProcess):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def test_every_operation_of_the_document_is_fuzzed(openapi):
    documented = {
        (op.method.upper(), op.path) for result in openapi.get_all_operations() if (op := result.ok())
    }
    assert documented == set(OPERATIONS)


# Generous bounds: a valid case may ask for many long choices, and a loaded CI machine runs the
# engine several times slower than a quiet one.
@pytest.mark.slow  # hundreds of generated requests against a server
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("method", "path", "mode", "examples"), CASES, ids=[f"{m} {p} {g.value}" for m, p, g, _ in CASES]
)
def test_no_generated_request_gets_a_server_error(openapi, server, method, path, mode, examples):
    operation = openapi[path][method]
    token = server.admin_token if path.startswith("/admin") else server.api_key
    statuses = {int(status) for status in operation.definition.raw["responses"]}

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same cases every run
        database=None,
    )
    def check(case) -> None:
        response = case.call(headers={"Authorization": f"Bearer {token}"}, timeout=120)
        assert response.status_code < 500, (case.body, case.path_parameters, response.text[:500])
        assert response.status_code in statuses, (response.status_code, case.body, response.text[:500])
        if response.status_code >= 400:
            body = response.json()
            assert set(body) == {"error"}, body
            assert set(body["error"]) == {"message", "type", "param", "code"}, body

    check()


# ---- hostile values, class by class, in every field the document names -----------------------------
# Deterministic: each field of each request schema, walked from the server's own OpenAPI document
# (nested objects and arrays included), gets each value of the classes that once broke the server
# (lone surrogates in strings, integers beyond 64 bits, non-finite numbers), on top of a valid body;
# then oversized and absurdly nested bodies. No 5xx, an OpenAI-shaped error, and a live engine after
# every case.

SURROGATES = ["\ud800", "ok\udfffok"]
HUGE_INTEGERS = [2**64, -(2**64), 2**63, 10**40]
NOT_FINITE = [float("nan"), float("inf"), float("-inf")]
VALID_BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
}
# Fields of each body the walk must find (so it is known to walk the document).
WALKED = {
    "/v1/completions": {"model", "stop", "seed", "top_k", "temperature", "max_tokens"},
    "/v1/chat/completions": {"model", "stop", "seed", "top_k", "temperature", "max_tokens"},
    "/v1/responses": {"model", "input", "seed", "top_k", "temperature", "max_output_tokens", "tools"},
}
VALID_OBJECTS = {  # a valid instance of each request component that a hostile field goes into
    "ChatMessage": {"role": "user", "content": "hi"},
    "TextContentPart": {"type": "text", "text": "hi"},
    "StreamOptions": {"include_usage": True},
}


def hostile_values(schema: dict, components: dict, depth: int = 0) -> list:
    """Values of `schema`'s types, each of a class that once broke the server."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return [
            {**VALID_OBJECTS.get(name, {}), field: value}
            for field, sub in components[name].get("properties", {}).items()
            for value in hostile_values(sub, components, depth + 1)
        ]
    values = []
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
        values += hostile_values(branch, components, depth)
    kind = schema.get("type")
    if kind == "string":
        values += SURROGATES
    elif kind == "integer":
        values += HUGE_INTEGERS
    elif kind == "number":
        values += HUGE_INTEGERS[:1] + NOT_FINITE
    elif kind == "array" and depth < 4:
        values += [[value] for value in hostile_values(schema.get("items", {}), components, depth + 1)]
    elif kind == "object":
        extra = schema.get("additionalProperties")
        values += [{SURROGATES[0]: 1}]
        if isinstance(extra, dict):
            values += [{"key": value} for value in hostile_values(extra, components, depth + 1)]
    return values


def hostile_cases(document: dict, path: str) -> list[tuple[str, dict]]:
    components = document["components"]["schemas"]
    body_schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = body_schema["$ref"].rsplit("/", 1)[-1]
    cases = []
    for field, schema in components[name]["properties"].items():
        for value in hostile_values(schema, components):
            cases.append((field, {**VALID_BODIES[path], field: value}))
    return cases


@pytest.fixture(scope="module")
def document(server: ServerProcess) -> dict:
    return server.get("/openapi.json").json()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", list(VALID_BODIES))
def test_hostile_values_in_every_field_get_a_4xx_and_the_engine_lives(server, document, path):
    cases = hostile_cases(document, path)
    fields = {field for field, _ in cases}
    assert WALKED[path] <= fields  # the walk found them
    statuses = {int(status) for status in document["paths"][path]["post"]["responses"]}
    with server.client() as client:
        for field, body in cases:
            # json.dumps escapes a lone surrogate as \ud800 and writes NaN / Infinity literals,
            # as a hostile client would.
            response = client.post(
                path, content=json.dumps(body), headers={"content-type": "application/json"}
            )
            assert 400 <= response.status_code < 500, (field, body, response.text[:300])
            assert response.status_code in statuses, (field, response.status_code)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert client.get("/health").status_code == 200, (field, body)


@pytest.mark.parametrize("path", list(VALID_BODIES))
def test_oversized_and_absurdly_nested_bodies_get_a_4xx_and_the_engine_lives(server, path):
    bodies = {
        "over the size limit": json.dumps({**VALID_BODIES[path], "user": "x" * (4 << 20)}),
        "nested 100000 deep": '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "messages": []}',
        "a million tiny fields": "{" + ",".join(f'"f{i}": 0' for i in range(300_000)) + "}",
    }
    with server.client() as client:
        for what, body in bodies.items():
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, (what, response.status_code, response.text[:300])
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}, what
            assert client.get("/health").status_code == 200, what
