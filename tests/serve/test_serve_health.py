"""`/health` must not lie: after `kill -9` of the engine's worker process the server answers
503 with the engine's error within the executor's detection bound (10 s), and goes on
answering 503 for as long as it lives; readiness drops, liveness stays, requests get a 503 with
Retry-After, an in-flight stream ends instead of hanging, the gauges and /admin/state say the
dead engine runs nothing, and SIGTERM still stops it cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.server_process import ENGINE_ARGS, ServerProcess
from tests.support.engine_processes import pid_alive, wait_until

DETECTION_BOUND_S = 10  # the executor's: a dead worker is noticed by an event or a polling backstop


def gauges(server: ServerProcess) -> dict[str, float]:
    """The unlabelled-but-for-the-model gauges of /metrics, by name."""
    families = text_string_to_metric_families(server.get("/metrics").text)
    return {f.name: f.samples[0].value for f in families if f.type == "gauge" and len(f.samples) == 1}


def test_health_readiness_and_requests_after_kill_9_of_the_engine(tiny_model):
    server = ServerProcess(tiny_model, *ENGINE_ARGS, "--api-key", "sk-kill", api_key="sk-kill")
    try:
        assert server.get("/health").json() == {"status": "ok"}
        assert server.get("/ready").status_code == 200
        engine_pid = server.engine_pid
        assert engine_pid != server.pid and pid_alive(engine_pid)

        # A long stream in flight when the engine dies: it must end, not hang.
        stream_lines: list[str] = []
        stream_started = threading.Event()

        def stream() -> None:
            body = {"prompt": [5] * 8, "max_tokens": 1000, "ignore_eos": True, "stream": True}
            with httpx.stream(
                "POST", server.url + "/v1/completions", json=body, headers=server.headers(), timeout=30
            ) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    stream_started.set()
                    if line:
                        stream_lines.append(line)

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert stream_started.wait(30)
        alive = gauges(server)
        assert alive["berth:num_requests_running"] == 1 and alive["berth:kv_cache_usage_perc"] > 0
        assert server.admin_state()["num_running"] == 1

        os.kill(engine_pid, signal.SIGKILL)
        killed_at = time.monotonic()

        assert wait_until(lambda: server.get("/health").status_code == 503, DETECTION_BOUND_S, interval=0.1)
        assert time.monotonic() - killed_at < DETECTION_BOUND_S
        body = server.get("/health").json()
        assert body["engine_dead"] is True
        assert "WorkerDiedError" in body["error"] and str(engine_pid) in body["error"], body

        reader.join(DETECTION_BOUND_S)
        assert not reader.is_alive(), "the in-flight stream hangs after the engine died"
        assert stream_lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in stream_lines if line.startswith("data: {")]
        assert "error" in events[-1] and events[-1]["error"]["code"] == "engine_dead"

        time.sleep(3)  # and it stays so
        for _ in range(3):
            response = server.get("/health")
            assert response.status_code == 503 and response.json()["engine_dead"] is True
        ready = server.get("/ready")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        assert server.get("/live").status_code == 200
        assert server.process.poll() is None, "the server exited instead of reporting the dead engine"

        refused = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert refused.status_code == 503
        assert int(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["code"] == "engine_dead"
        assert (
            server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}).status_code
            == 503
        )

        state = server.admin_state()
        assert state["engine_dead"] is True and state["admission"] == "failed" and state["error"]
        # A dead engine runs nothing and holds no blocks: no gauge keeps its last live value.
        assert (state["num_running"], state["num_waiting"], state["kv_blocks_used"]) == (0, 0, 0)
        dead = gauges(server)
        assert dead["berth:engine_healthy"] == 0
        assert dead["berth:num_requests_running"] == 0 and dead["berth:num_requests_waiting"] == 0
        assert dead["berth:kv_cache_usage_perc"] == 0
        assert server.process.poll() is None

        server.terminate()
        assert server.wait(15) == 0, server.output  # a dead world never hangs the exit
    finally:
        server.stop()


def test_a_stopped_engine_is_reported_stalled_and_stays_dead(tiny_model):
    """SIGSTOP leaves the worker alive and silent: `/health` turns 503 with reason "stalled"
    within the stall timeout, the request in flight gets its error, and SIGCONT revives
    nothing."""
    stall_timeout = 3
    server = ServerProcess(tiny_model, *ENGINE_ARGS, "--stall-timeout", str(stall_timeout))
    engine_pid = server.engine_pid
    try:
        events: list[dict] = []
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": [5] * 8, "max_tokens": 1000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    started.set()
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert started.wait(30)
        os.kill(engine_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()

        bound = stall_timeout + 5
        assert wait_until(lambda: server.get("/health").status_code == 503, bound, interval=0.1)
        assert time.monotonic() - stopped_at < bound
        body = server.get("/health").json()
        assert body["engine_dead"] is True and body["reason"] == "stalled", body
        assert "EngineStalledError: stalled: no step completed in 3 s" in body["error"], body
        reader.join(10)
        assert not reader.is_alive(), "the stream in flight hangs after the engine stalled"
        assert events[-1]["error"]["code"] == "engine_dead" and "stalled" in events[-1]["error"]["message"]

        with contextlib.suppress(ProcessLookupError):  # the stalled worker may be killed already
            os.kill(engine_pid, signal.SIGCONT)
        time.sleep(1)
        assert server.get("/health").status_code == 503  # sticky
        assert server.get("/ready").status_code == 503
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine_pid, signal.SIGCONT)
        server.stop()
