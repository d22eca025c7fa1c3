"""A real `berth serve` process for a test: started on a free 127.0.0.1 port, waited for with a
deadline, and always gone (SIGTERM, then SIGKILL) when the test is done with it."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.support.engine_processes import pid_alive, wait_until

LISTENING = "berth serve: listening on "
# The engine options every server in these tests runs with, and the reference engines too.
ENGINE_ARGS = ("--max-batch-size", "16", "--kv-blocks", "512", "--kv-block-size", "16")
ENGINE_OPTIONS = {"max_batch_size": 16, "kv_cache_blocks": 512, "kv_block_size": 16}
# The shared server (conftest.py): its name, length limit and credentials.
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256
API_KEY = "sk-test-berth"
ADMIN_TOKEN = "admin-test-berth"
CLIENT_TIMEOUT = 30  # seconds, for every HTTP client in these tests


class ServerProcess:
    def __init__(
        self,
        model: Path,
        *args: str,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        admin_token: str | None = None,
        startup_timeout: float = 60,
    ) -> None:
        self.api_key = api_key
        self.admin_token = admin_token
        command = [
            sys.executable, "-m", "berth", "serve", str(model), "--host", "127.0.0.1", "--port", "0", *args,
        ]  # fmt: skip
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
        child_env.update(env or {})
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=child_env,
            start_new_session=True,  # its own process group, as in a terminal (see `interrupt`)
        )
        self._lines: list[str] = []
        self._new_lines: queue.Queue[str | None] = queue.Queue()
        # Reads the output for the whole life of the process, so a full pipe never blocks it.
        threading.Thread(target=self._read_output, daemon=True).start()
        try:
            self.url = self._wait_for_url(startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.engine_pid: int = self.admin_state()["engine_pid"]

    def _read_output(self) -> None:
        for line in self.process.stdout:
            self._lines.append(line)
            self._new_lines.put(line)
        self._new_lines.put(None)

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._new_lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(
                    f"berth serve exited ({self.process.wait(5)}) before listening:\n{self.output}"
                )
            if line.startswith(LISTENING):
                return line[len(LISTENING) :].strip()
        raise TimeoutError(f"berth serve did not listen within {timeout} s:\n{self.output}")

    @property
    def output(self) -> str:
        return "".join(self._lines)

    @property
    def pid(self) -> int:
        return self.process.pid

    # ---- talking to it ----------------------------------------------------------------------------

    def headers(self, token: str | None = None) -> dict[str, str]:
        token = token if token is not None else self.api_key
        return {"Authorization": f"Bearer {token}"} if token else {}

    def client(self, timeout: float = 30) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, headers=self.headers())

    def get(self, path: str, **kwargs) -> httpx.Response:
        kwargs.setdefault("timeout", 10)
        kwargs.setdefault("headers", self.headers())
        return httpx.get(self.url + path, **kwargs)

    def post(self, path: str, json: dict, **kwargs) -> httpx.Response:
        kwargs.setdefault("timeout", 30)
        kwargs.setdefault("headers", self.headers())
        return httpx.post(self.url + path, json=json, **kwargs)

    def admin_state(self) -> dict:
        response = self.get("/admin/state", headers=self.headers(self.admin_token))
        response.raise_for_status()
        return response.json()

    def wait_idle(self, timeout: float = 10) -> bool:
        """True once no request is in flight (the server's counts, recorded in /metrics, and the
        engine's)."""

        def idle() -> bool:
            state = self.admin_state()
            counts = ("num_pending", "num_in_flight", "num_running", "num_waiting")
            return all(state[count] == 0 for count in counts)

        return wait_until(idle, timeout, interval=0.05)

    # ---- stopping it ------------------------------------------------------------------------------

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def interrupt(self) -> None:
        """Ctrl-C in a terminal: SIGINT to the whole process group, the engine worker included."""
        os.killpg(self.process.pid, signal.SIGINT)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL after `timeout`; also kills an engine worker left behind."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        engine_pid = getattr(self, "engine_pid", None)
        if engine_pid and engine_pid != self.pid and not wait_until(lambda: not pid_alive(engine_pid), 10):
            os.kill(engine_pid, signal.SIGKILL)
        return self.process.returncode
