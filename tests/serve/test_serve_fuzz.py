"""Fuzzing: schemathesis generates requests from the server's own OpenAPI document, both ones
that fit it (which run the model) and ones that break it. None may get a 5xx, every error comes
in OpenAI's shape, and every status is one the document lists for the operation.

Bounded: a fixed number of examples per operation and mode, no shrinking, no deadline (a request
runs the model) but a timeout on every call. (schemathesis' pytest plugin does not load under
pytest 9, so the strategies are driven by hypothesis directly.)"""

from __future__ import annotations

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
    ("GET", "/v1/models"): {POSITIVE: 3},
    ("GET", "/v1/models/{model}"): {POSITIVE: 10},
    ("GET", "/health"): {POSITIVE: 2},
    ("GET", "/ready"): {POSITIVE: 2},
    ("GET", "/live"): {POSITIVE: 2},
    ("GET", "/metrics"): {POSITIVE: 2},
    ("GET", "/admin/state"): {POSITIVE: 2},
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
