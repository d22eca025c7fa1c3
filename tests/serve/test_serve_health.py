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
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.server_process import ENGINE_ARGS, ServerProcess
from tests.support.engine_processes import WORKER_MODULE, pid_alive, wait_until

DETECTION_BOUND_S = 10  # the executor's: a dead worker is noticed by an event or a polling backstop


def gauges(server: ServerProcess) -> dict[str, float]:
    """The unlabelled-but-for-the-model gauges of /metrics, by name."""
    families = text_string_to_metric_families(server.get("/metrics").text)
    return {f.name: f.samples[0].value for f in families if f.type == "gauge" and len(f.samples) == 1}


def test_health_readiness_and_requests_after_kill_9_of_the_engine(tiny_model):
    server = ServerProcess(tiny_model, *ENGINE_ARGS, "--api-key", "sk-kill", api_key="sk-kill")
    engine_pid = None
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
        # Held mid-stream: 1,000 tokens of the tiny model take about a second, and on a loaded
        # machine the request could otherwise end before the reads below (seen in CI).
        os.kill(engine_pid, signal.SIGSTOP)
        alive = gauges(server)
        assert alive["berth_num_requests_running"] == 1 and alive["berth_kv_cache_usage_perc"] > 0
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
        assert dead["berth_engine_healthy"] == 0
        assert dead["berth_num_requests_running"] == 0 and dead["berth_num_requests_waiting"] == 0
        assert dead["berth_kv_cache_usage_perc"] == 0
        assert server.process.poll() is None

        server.terminate()
        assert server.wait(15) == 0, server.output  # a dead world never hangs the exit
    finally:
        if engine_pid is not None:  # a stopped engine would outlive a test that failed midway
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine_pid, signal.SIGKILL)
        server.stop()


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
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


def test_the_server_answers_while_the_engine_loads(tiny_model):
    """The server listens before the engine is up: a load held still (its worker stopped with
    SIGSTOP the moment it exists) is alive and says how far it has come; once it goes on, the
    same server becomes ready and serves."""
    process = subprocess.Popen(
        [sys.executable, "-m", "berth", "serve", str(tiny_model), "--host", "127.0.0.1", "--port", "0",
         *ENGINE_ARGS, "--admin-token", "tok"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    worker = None
    try:
        url = None
        for line in process.stdout:
            if "answering probes on" in line:
                url = line.split("answering probes on ")[1].split()[0]
                break
        assert url is not None, "the server never said it answers while loading"

        def loading_worker() -> int | None:
            children = psutil.Process(process.pid).children(recursive=True)
            return next((c.pid for c in children if WORKER_MODULE in " ".join(c.cmdline())), None)

        assert wait_until(lambda: loading_worker() is not None, 30, interval=0.005)
        worker = loading_worker()
        os.kill(worker, signal.SIGSTOP)  # the load holds still for as long as the test looks

        admin = {"Authorization": "Bearer tok"}
        assert httpx.get(url + "/live", timeout=5).status_code == 200
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "loading", health.text
        ready = httpx.get(url + "/ready", timeout=5)
        assert ready.status_code == 503
        progress = ready.json()["loading"]
        assert ready.json()["admission"] == "loading"
        assert progress["step"] in ("starting the engine", "loading weights", "sizing the KV cache"), progress
        state = httpx.get(url + "/admin/state", headers=admin, timeout=5).json()
        assert state["phase"] == "loading" and state["loading"]["seconds"] >= 0
        assert httpx.get(url + "/admin/state", timeout=5).status_code == 401  # the token, as always
        refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["code"] == "engine_loading"
        asleep = httpx.post(url + "/admin/sleep", json={}, headers=admin, timeout=5)
        assert asleep.status_code == 409 and asleep.json()["error"]["code"] == "conflict"

        os.kill(worker, signal.SIGCONT)
        assert wait_until(lambda: httpx.get(url + "/ready", timeout=5).status_code == 200, 60, interval=0.1)
        answer = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert httpx.get(url + "/admin/state", headers=admin, timeout=5).json()["engine_pid"] == worker
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
