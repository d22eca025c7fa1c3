"""A real `berth serve` process for a test: started on a free 127.0.0.1 port, waited for with a
deadline, and always gone (SIGTERM, then SIGKILL) when the test is done with it."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.support.engine_processes import pid_alive, wait_until

LISTENING = "berth {command}: listening on "
ATTACH_AT = "berth {command}: frontends attach at "
ADMIN_AT = "berth {command}: admin routes on "
# The engine options every server in these tests runs with, and the reference engines too.
ENGINE_ARGS = ("--max-batch-size", "16", "--kv-blocks", "512", "--kv-block-size", "16")
ENGINE_OPTIONS = {"max_batch_size": 16, "kv_cache_blocks": 512, "kv_block_size": 16}
# The shared server (conftest.py): its name, length limit and credentials.
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256
MAX_REQUEST_BODY_BYTES = 7 << 19  # 3.5 MiB: under the default, over a 3 MB prompt
API_KEY = "sk-test-berth"
ADMIN_TOKEN = "admin-test-berth"
CLIENT_TIMEOUT = 30  # seconds, for every HTTP client in these tests


class ServerProcess:
    """`berth serve MODEL ARGS...` (or, with `command="launch"`, `berth launch MODEL ARGS`), or
    with `model=None` an attached frontend (`berth serve --attach ...` in `args`), which owns no
    engine: stopping it never touches the engine."""

    def __init__(
        self,
        model: Path | None,
        *args: str,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        admin_token: str | None = None,
        startup_timeout: float = 60,
        command: str = "serve",
        preexec_fn: Callable[[], None] | None = None,
        router: bool = False,
    ) -> None:
        self.api_key = api_key
        self.admin_token = admin_token
        self.owns_engine = model is not None
        self._listening = LISTENING.format(command=command)
        self._attach_at = ATTACH_AT.format(command=command)
        self._command = command
        command_line = [
            sys.executable, "-m", "berth", command, *([str(model)] if model else []),
            "--host", "127.0.0.1", "--port", "0", *args,
        ]  # fmt: skip
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
        child_env.update(env or {})
        self.process = subprocess.Popen(
            command_line,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=child_env,
            start_new_session=True,  # its own process group, as in a terminal (see `interrupt`)
            preexec_fn=preexec_fn,  # e.g. joining a memory cgroup (tests/support/memory_cgroup.py)
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
        # A router (`berth serve --route`) has no engine of its own.
        self.engine_pid: int | None = None if router else self.admin_state()["engine_pid"]

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
            if line.startswith(self._listening):
                return line[len(self._listening) :].strip()
        raise TimeoutError(f"berth serve did not listen within {timeout} s:\n{self.output}")

    @property
    def output(self) -> str:
        return "".join(self._lines)

    @property
    def attach_address(self) -> str:
        """Where frontends attach (a server started with --attach-port)."""
        line = next(line for line in self._lines if line.startswith(self._attach_at))
        return line[len(self._attach_at) :].strip()

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

    @property
    def admin_url(self) -> str:
        """Where /admin answers: the --admin-port's listener when the server has one."""
        said = ADMIN_AT.format(command=self._command)
        line = next((line for line in self._lines if line.startswith(said)), None)
        return line[len(said) :].strip().removesuffix("/admin") if line else self.url

    def admin_state(self) -> dict:
        response = httpx.get(
            self.admin_url + "/admin/state", headers=self.headers(self.admin_token), timeout=10
        )
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
        engine_pid = getattr(self, "engine_pid", None) if self.owns_engine else None
        if engine_pid and engine_pid != self.pid and not wait_until(lambda: not pid_alive(engine_pid), 10):
            os.kill(engine_pid, signal.SIGKILL)
        return self.process.returncode


def keyed_server(model: Path, *args: str) -> ServerProcess:
    """`berth serve MODEL ARGS` with an API key and an admin token from the environment, as a
    deployment passes them."""
    return ServerProcess(
        model,
        *args,
        env={"BERTH_API_KEY": API_KEY, "BERTH_ADMIN_TOKEN": ADMIN_TOKEN},
        api_key=API_KEY,
        admin_token=ADMIN_TOKEN,
    )


def long_context_copy(model: Path, folder: Path, positions: int) -> Path:
    """The same weights with room for a stream no drain outlasts (RoPE has no learned positions)."""
    copy = shutil.copytree(model, folder / "long-context")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return copy
