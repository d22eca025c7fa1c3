"""Real `berth serve` processes on 127.0.0.1 for the operator to poll, and a real `kill -9` of
their engine worker process.

Each launcher pod the simulated kubelet runs gets its own `berth serve` on a tiny checkpoint
(proxy + worker processes, as in production). The server starts in the background, as a real
launcher's does: until it answers, the operator sees an unreachable engine ("Starting").
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from berth.operator import render
from berth.operator.health import Address
from berth.ports import free_port, free_ports  # noqa: F401  (tests import them from here)
from tests.support.engine_processes import pid_alive

ADMIN_TOKEN = "test-admin-token"
# A server imports torch, loads the model and spawns its worker: seconds on a quiet 2-core
# machine, many more while other tests run. Tests wait for Ready with this bound.
START_TIMEOUT = 90.0
STOP_TIMEOUT = 10.0
# Small engine options: the tests only need the engine to live, answer and die.
ENGINE_OPTIONS = ("--kv-blocks", "32", "--max-batch-size", "4", "--shutdown-timeout", "1")


def server_command(
    model: Path, host: str, port: int, extra_args: Sequence[str] = (), admin_port: int | None = None
) -> list[str]:
    admin = ["--admin-port", str(admin_port)] if admin_port is not None else []
    return [
        sys.executable, "-m", "berth", "serve", str(model), "--host", host, "--port", str(port),
        *admin, "--log-level", "warning", *ENGINE_OPTIONS, *extra_args,
    ]  # fmt: skip


@dataclass
class EngineEndpoint:
    process: asyncio.subprocess.Process
    host: str
    port: int
    admin_token: str = ADMIN_TOKEN
    admin_port: int | None = None  # the server's --admin-port (None: /admin on `port`)

    @property
    def address(self) -> Address:
        return Address(self.host, self.port, self.admin_port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def get(self, path: str) -> httpx.Response:
        """GET `path` with the admin token, on the admin port for /admin paths."""
        port = self.admin_port if path.startswith("/admin") and self.admin_port else self.port
        async with httpx.AsyncClient() as client:
            return await client.get(
                f"http://{self.host}:{port}{path}",
                headers={"Authorization": f"Bearer {self.admin_token}"},
                timeout=5.0,
            )

    async def wait_up(self, timeout: float = START_TIMEOUT) -> None:
        """Until the server answers /live (its engine is loaded by then)."""
        deadline = asyncio.get_running_loop().time() + timeout
        async with httpx.AsyncClient() as client:
            while True:
                if self.process.returncode is not None:
                    raise RuntimeError(f"berth serve exited with {self.process.returncode} before answering")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/live", timeout=1.0)).status_code == 200:
                        return
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"berth serve did not answer /live within {timeout} s")
                await asyncio.sleep(0.05)

    async def engine_pid(self) -> int:
        await self.wait_up()
        return int((await self.get("/admin/state")).json()["engine_pid"])

    async def kill_engine(self) -> int:
        """`kill -9` the engine worker process; returns its PID."""
        pid = await self.engine_pid()
        os.kill(pid, signal.SIGKILL)
        return pid

    @property
    def exited(self) -> bool:
        return self.process.returncode is not None or not pid_alive(self.process.pid)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT; bounded whatever happens. Polled, never
        `process.wait()`: an in-process kopf operator cancels, when it stops, every task born
        during its run, and a wait on a process started then could hang whoever waits."""
        if self.process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.terminate()
        if not await self._exited(STOP_TIMEOUT):
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            if not await self._exited(STOP_TIMEOUT):
                raise RuntimeError(f"berth serve {self.process.pid} outlived SIGKILL by {STOP_TIMEOUT} s")

    async def _exited(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.process.returncode is None and pid_alive(self.process.pid):
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True


async def start_engine_endpoint(
    model: Path,
    env: Mapping[str, str] | None = None,
    admin_token: str = ADMIN_TOKEN,
    extra_args: Sequence[str] = (),
) -> EngineEndpoint:
    """Start `berth serve` on a free 127.0.0.1 port, its admin routes on another (as a launcher
    pod's are); returns at once (see `wait_up`)."""
    host, (port, admin_port) = "127.0.0.1", free_ports(2)
    process = await asyncio.create_subprocess_exec(
        *server_command(model, host, port, extra_args, admin_port),
        env={**os.environ, "BERTH_ADMIN_TOKEN": admin_token, **(env or {})},
        stdout=asyncio.subprocess.DEVNULL,
    )
    return EngineEndpoint(process, host, port, admin_token, admin_port)


SecretReader = Callable[[str, str], "Mapping[str, Any] | None"]  # (namespace, name) -> Secret


def pod_admin_token(pod: Mapping[str, Any], read_secret: SecretReader) -> str | None:
    """The BERTH_ADMIN_TOKEN a launcher pod's container gets from its Secret (as a kubelet
    resolves `valueFrom.secretKeyRef`)."""
    for var in pod["spec"]["containers"][0].get("env") or []:
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if var["name"] == "BERTH_ADMIN_TOKEN" and ref:
            secret = read_secret(pod["metadata"]["namespace"], ref["name"]) or {}
            data = (secret.get("data") or {}).get(ref["key"])
            return base64.b64decode(data).decode() if data else None
    return None


# TEST-NET-1 (RFC 5737): an address where nothing ever answers.
UNANSWERED_ADDRESS = ("192.0.2.1", 8000)


@dataclass
class EngineFleet:
    """One server per launcher pod: the kubelet hook starts it when the pod "runs", stops it when
    the pod is gone, and the operator's address resolver maps the pod to it."""

    model: Path  # the checkpoint every server loads
    engine_args: tuple[str, ...] = ()  # more `berth serve` flags for every server
    # Reads the pod's Secrets, so each server takes the admin token the operator generated.
    read_secret: SecretReader | None = None
    endpoints: dict[str, EngineEndpoint] = field(default_factory=dict)  # launcher pod uid -> server
    # Servers of pods that are gone: told to stop, maybe still draining and exiting.
    stopping: list[EngineEndpoint] = field(default_factory=list)
    _reapers: set[asyncio.Task[None]] = field(default_factory=set)
    started: list[str] = field(default_factory=list)  # pod names, in start order
    _names: dict[str, str] = field(default_factory=dict)  # launcher pod uid -> pod name
    _stopped: set[str] = field(default_factory=set)  # launcher pod uids whose server was stopped

    @staticmethod
    def is_launcher(pod: Mapping[str, Any]) -> bool:
        return pod["metadata"].get("labels", {}).get("berth.dev/role") == "launcher"

    async def on_pod_start(self, pod: dict[str, Any]) -> None:
        if self.is_launcher(pod):
            uid, name = pod["metadata"]["uid"], pod["metadata"]["name"]
            token = pod_admin_token(pod, self.read_secret) if self.read_secret is not None else None
            # The name the pod's command gives the weights (spec.model.revision), as `berth launch`
            # would report it; the weights themselves are always the fleet's model.
            _, label = render.launcher_model(pod["spec"]["containers"][0].get("command") or [])
            revision = ["--model-revision", label] if label else []
            self.endpoints[uid] = await start_engine_endpoint(
                self.model, admin_token=token or ADMIN_TOKEN, extra_args=[*self.engine_args, *revision]
            )
            self._names[uid] = name
            self.started.append(name)

    async def on_pod_stop(self, pod: dict[str, Any]) -> None:
        """SIGTERM now; the server then stops on its own time (a drain, the engine's shutdown,
        the interpreter's exit: seconds), SIGKILL after STOP_TIMEOUT, while the kubelet goes on
        starting other pods, as a real node's does. `stop_all` waits for every one of them."""
        endpoint = self.endpoints.pop(pod["metadata"]["uid"], None)
        if endpoint is not None:
            self._stopped.add(pod["metadata"]["uid"])
            self.stopping.append(endpoint)
            reaper = asyncio.ensure_future(endpoint.stop())
            self._reapers.add(reaper)
            # Its outcome is stop_all's to report (it stops each again, which waits or returns).
            reaper.add_done_callback(lambda task: task.cancelled() or task.exception())
            reaper.add_done_callback(self._reapers.discard)

    def all_stopped(self) -> bool:
        """No launcher pod's server runs any more (every stopped one has exited)."""
        return not self.endpoints and all(endpoint.exited for endpoint in self.stopping)

    def resolve(self, pod: Mapping[str, Any]) -> Address | None:
        """The operator's address resolver in tests: launcher pod -> its server on 127.0.0.1."""
        endpoint = self.endpoints.get(pod["metadata"]["uid"])
        if endpoint is None and pod["metadata"]["uid"] in self._stopped:
            # A pod whose processes are gone while the API still lists it (its node was lost):
            # its IP stays in its status, and nothing answers there any more.
            return UNANSWERED_ADDRESS
        return endpoint.address if endpoint is not None else None

    def for_pod(self, name: str) -> EngineEndpoint:
        # The newest server of that pod name (a restarted world reuses its launcher's name).
        matches = [endpoint for uid, endpoint in self.endpoints.items() if self._names.get(uid) == name]
        assert matches, f"no running server for pod {name}"
        return matches[-1]

    async def stop_all(self) -> None:
        """Stops every server (those still running and those told to stop), all at once."""
        everything = [*self.endpoints.values(), *self.stopping]
        results = await asyncio.gather(*(endpoint.stop() for endpoint in everything), return_exceptions=True)
        self.endpoints.clear()
        self.stopping.clear()
        for result in results:
            if isinstance(result, BaseException):
                raise result
