"""Disaggregated serving over real processes: a context server (`--role context`), a generation
server (`--role generation`, another KV block size) and the router (`berth serve --route`), each
a `berth serve` process. Answers through the router equal a single server's (plain, streamed,
chat, stop strings, `n` seeded choices); roles refuse what is not theirs; a context server killed
after prefill fails the request clearly and the generation server keeps no block."""

from __future__ import annotations

import http.server
import json
import os
import secrets
import signal
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.server_process import API_KEY, ENGINE_ARGS, MODEL_NAME, ServerProcess
from tests.support.engine_processes import pid_alive, wait_until

KEY = {"BERTH_KV_TRANSFER_KEY": secrets.token_hex(32)}
PROMPTS = [[5, 6, 7], list(range(20, 57)), list(range(100, 118))]


def engine_server(tiny_model, *args: str) -> ServerProcess:
    return ServerProcess(tiny_model, *ENGINE_ARGS, "--served-model-name", MODEL_NAME, *args, env=KEY)


@pytest.fixture(scope="module")
def split(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv")
    servers = []
    try:
        servers.append(
            engine_server(tiny_model, "--role", "context", "--kv-transfer-endpoint", f"ipc://{folder}/kv")
        )
        servers.append(engine_server(tiny_model, "--role", "generation", "--kv-block-size", "8"))
        context, generation = servers
        routes = ("--route", f"context={context.url}", "--route", f"generation={generation.url}")
        servers.append(ServerProcess(None, *routes, router=True))
        yield servers
    finally:
        for server in reversed(servers):
            server.stop()


def complete(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json={"model": MODEL_NAME, **body}, headers=headers, timeout=60
    )


def streamed_text(url: str, path: str, body: dict) -> str:
    text = []
    with httpx.stream(
        "POST", url + path, json={"model": MODEL_NAME, "stream": True, **body}, timeout=60
    ) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text)


def test_answers_through_the_router_equal_a_single_servers(split, server):
    router = split[2]
    plain = {"Authorization": f"Bearer {API_KEY}"}
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        expected = complete(server.url, body, plain).json()["choices"][0]
        routed = complete(router.url, body)
        assert routed.status_code == 200, routed.text
        assert routed.json()["choices"][0]["text"] == expected["text"]
        assert "kv_handle" not in routed.json() or routed.json()["kv_handle"] is None
        assert streamed_text(router.url, "/v1/completions", body) == expected["text"]
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = complete(server.url, body, plain).json()["choices"][0]["text"]
    body["stop"] = [whole[len(whole) // 2 :][:2]]
    expected = complete(server.url, body, plain).json()["choices"][0]
    routed = complete(router.url, body).json()["choices"][0]
    assert (routed["text"], routed["finish_reason"]) == (expected["text"], "stop"), (whole, body["stop"])
    chat = {
        "messages": [{"role": "user", "content": "the quick brown fox"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    expected = httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": MODEL_NAME, **chat}, headers=plain, timeout=60
    )
    assert (
        streamed_text(router.url, "/v1/chat/completions", chat)
        == expected.json()["choices"][0]["message"]["content"]
    )


def texts_by_choice(url: str, path: str, body: dict) -> tuple[dict[int, str], dict]:
    """Each choice's streamed text, and the usage chunk."""
    texts: dict[int, str] = {}
    usage = {}
    with httpx.stream(
        "POST", url + path, json={"model": MODEL_NAME, "stream": True, **body}, timeout=60
    ) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            piece = choice.get("text") or choice.get("delta", {}).get("content") or ""
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts, usage


def token_counts(usage: dict) -> dict:
    """The usage's counts (its cached_tokens are each server's prefix cache's own)."""
    return {key: usage[key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


def test_n_choices_through_the_router_equal_a_single_servers(split, server):
    """`n` splits, split `i` seeded `seed + i` as a single engine's sequence `i` is: the same
    choices, streamed or not, with the prompt counted once in the usage."""
    router = split[2]
    plain = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "prompt": PROMPTS[1],
        "max_tokens": 10,
        "ignore_eos": True,
        "n": 3,
        "seed": 77,
        "temperature": 1.0,
    }
    expected = complete(server.url, body, plain).json()
    routed = complete(router.url, body).json()
    assert [c["text"] for c in routed["choices"]] == [c["text"] for c in expected["choices"]]
    assert [c["index"] for c in routed["choices"]] == [0, 1, 2]
    assert token_counts(routed["usage"]) == token_counts(expected["usage"]) == {
        "prompt_tokens": len(PROMPTS[1]), "completion_tokens": 30, "total_tokens": len(PROMPTS[1]) + 30,
    }  # fmt: skip
    assert len({c["text"] for c in routed["choices"]}) > 1  # sampled: the seeds differ per choice
    streaming = {**body, "stream_options": {"include_usage": True}}
    texts, usage = texts_by_choice(router.url, "/v1/completions", streaming)
    assert texts == {c["index"]: c["text"] for c in expected["choices"]}
    assert token_counts(usage) == token_counts(expected["usage"])
    chat = {"messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 6, "n": 2}
    chat_expected = httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": MODEL_NAME, **chat, "temperature": 0},
        headers=plain, timeout=60,
    ).json()  # fmt: skip
    texts, _ = texts_by_choice(router.url, "/v1/chat/completions", {**chat, "temperature": 0})
    assert texts == {c["index"]: c["message"]["content"] for c in chat_expected["choices"]}
    one_token = complete(router.url, {**body, "max_tokens": 1})  # every choice ended by its first token
    assert [c["finish_reason"] for c in one_token.json()["choices"]] == ["length"] * 3


def test_the_two_halves_share_the_request_id_in_their_logs(split):
    context, generation, router = split
    reply = complete(router.url, {"prompt": [9, 10, 11, 12], "max_tokens": 4}, {"X-Request-Id": "trace-42"})
    assert reply.status_code == 200, reply.text
    for server in (context, generation):
        assert "trace-42: engine request" in server.output, server.output[-2000:]


def test_roles_refuse_what_is_not_theirs_and_the_router_refuses_best_of(split):
    context, generation, router = split
    body = {"prompt": [5, 6, 7], "max_tokens": 4}
    for server in (context, generation):
        reply = complete(server.url, body)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "wrong_role", reply.text
    assert httpx.get(f"{router.url}/health", timeout=30).json() == {"healthy": True, "unhealthy": []}
    ready = httpx.get(f"{router.url}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["roles_without_a_ready_server"] == [], ready.text
    assert httpx.get(f"{router.url}/v1/models", timeout=30).json()["data"][0]["id"] == MODEL_NAME
    reply = complete(router.url, {**body, "n": 2, "best_of": 3})
    assert reply.status_code == 400 and "best of several" in reply.json()["error"]["message"]
    ended = complete(router.url, {**body, "max_tokens": 1})  # the context server's answer is the whole answer
    assert ended.status_code == 200 and ended.json()["choices"][0]["finish_reason"] == "length"


class Unready:
    """A server that answers every request 503, as a parked or draining engine does."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self) -> None:
                self.send_response(503)
                self.send_header("Retry-After", "1")
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = answer

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens once it is closed


def test_the_router_passes_over_servers_that_are_not_ready(split):
    """A route's server that refuses connections or answers 503 is passed over while another
    of its role is left (as a Service passes over unready pods); the router stays ready."""
    context, generation, _ = split
    unready = Unready()
    routes = (
        ("--route", f"context={unready.url},{closed_port_url()},{context.url}"),
        ("--route", f"generation={closed_port_url()},{unready.url},{generation.url}"),
    )
    router = ServerProcess(None, *routes[0], *routes[1], router=True)
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        expected = complete(split[2].url, body).json()["choices"][0]["text"]
        for _ in range(3):  # each turn starts at another server of each role
            reply = complete(router.url, body)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected, reply.text
            assert streamed_text(router.url, "/v1/completions", body) == expected
        assert httpx.get(f"{router.url}/ready", timeout=30).status_code == 200
        for _ in range(3):
            assert httpx.get(f"{router.url}/v1/models", timeout=30).json()["data"][0]["id"] == MODEL_NAME
        samples = router_samples(router.url)
    finally:
        router.stop()
        unready.stop()
    # Its /metrics say which servers took each half and which were passed over. Each request's
    # turn starts where the last one ended (at the ready server's next), so it meets all three:
    # 6 requests, and 3 model lists on the generation role.
    upstream = "berth_router_upstream_requests_total"
    for role, ready, halves in (("context", context, 6), ("generation", generation, 9)):
        for url, outcome in ((unready.url, "not_ready"), (ready.url, "taken")):
            assert samples[upstream, (("outcome", outcome), ("role", role), ("server", url))] == halves
        unreachable = [
            value
            for (name, labels), value in samples.items()
            if name == upstream and dict(labels)["role"] == role and dict(labels)["outcome"] == "unreachable"
        ]
        assert sorted(unreachable) == [0, 0, halves]  # the closed port of each role, never the others
    assert samples["berth_router_requests_total", (("code", "200"),)] == 6
    assert samples["berth_router_kv_handovers_total", ()] == 6
    assert samples["berth_router_context_duration_seconds_count", ()] == 6
    assert samples["berth_router_requests_in_flight", ()] == 0


def router_samples(url: str) -> dict[tuple[str, tuple], float]:
    """(series name, sorted labels) -> value, from a router's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_routers_metrics_pass_promtool(split):
    router = split[2]
    assert complete(router.url, {"prompt": [5, 6, 7], "max_tokens": 3}).status_code == 200
    assert complete(router.url, {"prompt": [5, 6, 7], "n": 0}).status_code == 400
    text = httpx.get(f"{router.url}/metrics", timeout=30).text
    checked = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    samples = router_samples(router.url)
    assert samples["berth_router_requests_total", (("code", "400"),)] >= 1
    assert samples["berth_router_kv_handovers_total", ()] >= 1


def test_a_client_that_leaves_mid_stream_aborts_on_both_servers(split):
    """The router closes the generation server's stream; its request is aborted there, and the
    context server's pin was released after the pull: neither keeps a block."""
    context, generation, router = split
    body = {"model": MODEL_NAME, "prompt": PROMPTS[2], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        next(line for line in reply.iter_lines() if line.startswith("data: "))  # streaming: now leave
    for server in (generation, context):  # the abort's own response brings fresh stats
        assert wait_until(lambda s=server: s.admin_state()["num_pending"] == 0, 30), server.admin_state()
        assert wait_until(lambda s=server: s.admin_state()["kv_blocks_used"] == 0, 10), server.admin_state()
    aborted = 'berth_request_success_total{finished_reason="abort",model_name="tiny"} 1.0'
    assert aborted in generation.get("/metrics").text  # it ended there as an abort, not by its length


def test_a_key_mismatch_and_a_context_server_killed_after_prefill_fail_clearly_and_leak_nothing(
    split, tiny_model, tmp_path
):
    """A context server of another deployment (another key), then killed after its prefill."""
    _, generation, _ = split
    doomed = ServerProcess(
        tiny_model, *ENGINE_ARGS, "--served-model-name", MODEL_NAME, "--role", "context",
        "--kv-transfer-endpoint", f"ipc://{tmp_path}/kv",
        env={"BERTH_KV_TRANSFER_KEY": secrets.token_hex(32)},
    )  # fmt: skip
    try:
        first = complete(
            doomed.url, {"prompt": PROMPTS[1], "max_tokens": 8, "disaggregated": {"context_only": True}}
        )
        handle = first.json()["kv_handle"]
        assert handle is not None and handle["num_tokens"] == len(PROMPTS[1])
        body = {"prompt": PROMPTS[1], "max_tokens": 8, "disaggregated": {"kv_handle": handle, "timeout": 1.0}}
        mismatch = complete(generation.url, body)
        assert mismatch.status_code >= 400, mismatch.text
        assert "not signed with this engine's KV transfer key" in mismatch.json()["error"]["message"]
        os.kill(doomed.engine_pid, signal.SIGKILL)  # the engine, which holds the pinned blocks
        assert wait_until(lambda: not pid_alive(doomed.engine_pid), 10)
        failed = complete(generation.url, body)
        assert failed.status_code >= 400, failed.text
        assert "did not answer within the transfer timeout" in failed.json()["error"]["message"]
        body["disaggregated"]["fallback"] = "local"  # or the generation server runs the prompt itself
        assert complete(generation.url, body).status_code == 200
        state = generation.admin_state()
        assert state["kv_blocks_used"] == 0, state
    finally:
        doomed.stop()


def test_a_generation_engine_killed_mid_pull_leaves_no_pin_on_the_context_server(split):
    """The last test of the module: it kills the shared generation server's engine. Whether it
    died before, during or after its pull, the context server's blocks come back (released, or
    by the pin's timeout), and the client hears an error, not silence."""
    context, generation, router = split
    body = {"prompt": PROMPTS[1], "max_tokens": 8}
    first = complete(context.url, {**body, "disaggregated": {"context_only": True, "pin_seconds": 2.0}})
    continuation = {**body, "disaggregated": {"kv_handle": first.json()["kv_handle"]}}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(complete, generation.url, continuation)
        os.kill(generation.engine_pid, signal.SIGKILL)
        try:
            reply = answer.result(timeout=60)
            assert reply.status_code != 200 or reply.json()["choices"][0]["finish_reason"] is not None
        except httpx.HTTPError:
            pass  # the server may close the connection: an answer all the same
    assert wait_until(lambda: context.admin_state()["kv_blocks_used"] == 0, 20), context.admin_state()
    assert complete(router.url, body).status_code >= 500  # the route's generation half is dead, and says so
    health = httpx.get(f"{router.url}/health", timeout=30)
    assert health.status_code == 503 and health.json()["unhealthy"] == [generation.url]
    ready = httpx.get(f"{router.url}/ready", timeout=30)  # the router's readiness probe
    assert ready.status_code == 503 and ready.json()["roles_without_a_ready_server"] == ["generation"]
