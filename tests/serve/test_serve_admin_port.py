"""`--admin-port`: the admin routes on a listener of their own, which a Kubernetes Service never
exposes (the operator renders `berth launch --admin-port 8002` and reaches it on the pod IP).

One real server on two free ports: /admin answers only on the admin port (with its token, as
always), the OpenAI API and the probes only on the public one; each port answers the other's
paths with an OpenAI-shaped 404.
"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from tests.serve.server_process import ADMIN_TOKEN, API_KEY, ENGINE_ARGS, ServerProcess, keyed_server
from tests.serve.test_serve_cli import assert_refused, berth
from tests.support.engine_endpoint import free_port


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    process = keyed_server(tiny_model, *ENGINE_ARGS, "--admin-port", "0")
    yield process
    assert process.stop() == 0, process.output


def test_admin_routes_answer_only_on_the_admin_port(server: ServerProcess):
    admin_url = server.admin_url
    assert admin_url != server.url
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    state = httpx.get(f"{admin_url}/admin/state", headers=admin, timeout=10)
    assert state.status_code == 200 and state.json()["admission"] == "running"
    assert httpx.get(f"{admin_url}/admin/state", timeout=10).status_code == 401  # the token, as always

    for path in ("/admin/state", "/admin/sleep"):
        public = httpx.request(
            "GET" if path.endswith("state") else "POST", f"{server.url}{path}", headers=admin, timeout=10
        )
        assert public.status_code == 404, public.text
        assert public.json()["error"]["code"] == "not_found"


def test_the_api_and_probes_answer_only_on_the_public_port(server: ServerProcess):
    admin_url = server.admin_url
    api = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/v1/models", "/health", "/ready", "/metrics"):
        assert httpx.get(f"{server.url}{path}", headers=api, timeout=10).status_code == 200, path
        assert httpx.get(f"{admin_url}{path}", headers=api, timeout=10).status_code == 404, path


def test_admin_port_equal_to_the_public_port_is_refused(tiny_model: Path):
    port = str(free_port())
    result = berth("serve", str(tiny_model), "--port", port, "--admin-port", port)
    assert_refused(result, "--admin-port must differ")


def test_a_taken_admin_port_is_refused_before_loading(tiny_model: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        result = berth("serve", str(tiny_model), "--port", "0", "--admin-port", busy)
    assert_refused(result, f"cannot listen on 127.0.0.1:{busy}")
