"""SIGTERM (or Ctrl-C): the server stops admitting (new requests get 503 + Retry-After, /ready 503) but keeps
answering while the requests in flight finish, aborts what the grace period cannot finish, and
exits 0 — never hangs."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.serve.server_process import ENGINE_ARGS, ServerProcess, long_context_copy
from tests.support.engine_processes import pid_alive, wait_until


class Stream:
    """A streamed completion read on a thread: its events, in order, as JSON (or "[DONE]")."""

    def __init__(self, server: ServerProcess, body: dict) -> None:
        self.events: list = []
        self.status: int | None = None
        self.started = threading.Event()
        self._hang_up = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(server, body), daemon=True)
        self._thread.start()

    def _read(self, server: ServerProcess, body: dict) -> None:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if self._hang_up.is_set():
                    break  # leaving the block closes the connection: the server aborts the request
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    self.started.set()
        self.started.set()

    def hang_up(self) -> None:
        """Closes the connection at the next event, as a client that goes away does."""
        self._hang_up.set()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def finish_reasons(self) -> dict[int, str]:
        return {
            c["index"]: c["finish_reason"]
            for e in self.events
            if isinstance(e, dict)
            for c in e.get("choices", [])
            if c["finish_reason"]
        }


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_a_stop_signal_drains_the_request_in_flight_then_exits_0(tiny_model, tmp_path, stop):
    """Ctrl-C reaches the engine worker too: it must leave the drain to the server."""
    # A grace period far longer than the request needs, even on a loaded machine: this test
    # is about draining, the next one about what a short grace period cuts off.
    model = long_context_copy(tiny_model, tmp_path, 8192)
    server = ServerProcess(model, *ENGINE_ARGS, "--kv-blocks", "1024", "--shutdown-timeout", "200")
    try:
        # 6,000 steps, seconds of work: in flight while the probes run. CI once saw 1,000 steps
        # end between the first token and the probes, on a loaded machine.
        n, max_tokens = 2, 6000
        body = {"prompt": [5] * 8, "n": n, "max_tokens": max_tokens, "ignore_eos": True}
        stream = Stream(server, {**body, "stream_options": {"include_usage": True}})
        assert stream.started.wait(30) and stream.status == 200

        server.terminate() if stop == "sigterm" else server.interrupt()

        # Draining: still listening, no longer admitting.
        ready = server.get("/ready")
        assert ready.status_code == 503 and ready.json()["draining"] is True
        assert server.get("/health").status_code == 200  # the engine is fine
        refused = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["code"] == "shutting_down"
        assert server.admin_state()["draining"] is True

        assert stream.join(200), "the request in flight did not finish"
        assert stream.events[-1] == "[DONE]"
        assert stream.finish_reasons() == dict.fromkeys(range(n), "length")
        assert stream.events[-2]["usage"]["completion_tokens"] == n * max_tokens
        finished_at = time.monotonic()

        assert server.wait(15) == 0, server.output
        assert time.monotonic() - finished_at < 10
        assert "berth serve: stopped" in server.output
        assert wait_until(lambda: not pid_alive(server.engine_pid), 10)
    finally:
        server.stop()


def test_sigterm_aborts_what_the_grace_period_cannot_finish(tiny_model):
    grace = 1.0
    server = ServerProcess(tiny_model, *ENGINE_ARGS, "--kv-blocks", "1024", "--shutdown-timeout", str(grace))
    try:
        n = 16  # 16 000 tokens: several times the grace period on this model
        stream = Stream(server, {"prompt": [5] * 8, "n": n, "max_tokens": 1000, "ignore_eos": True})
        assert stream.started.wait(30) and stream.status == 200

        server.terminate()
        signalled_at = time.monotonic()

        assert stream.join(grace + 10), "the request in flight hangs past the grace period"
        assert stream.events[-1] == "[DONE]"  # the answer ends properly, with the aborted choices
        reasons = stream.finish_reasons()
        assert set(reasons) == set(range(n)) and "abort" in reasons.values(), reasons
        assert server.wait(15) == 0, server.output
        assert time.monotonic() - signalled_at < grace + 10
        assert wait_until(lambda: not pid_alive(server.engine_pid), 10)
    finally:
        server.stop()
