"""What the test kubelet knows about each pod and container, and how it finds, kills and lets
go of a container's processes (a container is its mount namespace: every process in it)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import pod_network

# The real kubelet's bounds on a termination message taken from the log.
TERMINATION_LOG_LINES, TERMINATION_LOG_BYTES = 80, 2048


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class PodSetupError(Exception):
    """A pod cannot start yet (a missing Secret) or ever (a feature this kubelet lacks)."""

    def __init__(self, reason: str, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.permanent = permanent


@dataclass
class Execution:
    """One run of one container's command: what the renderer-coverage test reads."""

    namespace: str
    pod: str
    role: str | None
    container: str
    argv: list[str]
    log: Path
    pid: int | None = None
    ready: bool = False  # became ready at least once
    exit_code: int | None = None
    killed_by: str | None = None  # a failed probe ("liveness", "startup"), if that ended it

    def log_tail(self, lines: int = TERMINATION_LOG_LINES, limit: int = TERMINATION_LOG_BYTES) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])[-limit:]


# Every container command any kubelet ran in this test session, in order.
EXECUTIONS: list[Execution] = []


def mount_namespace_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def processes_in(mount_namespace: str) -> list[int]:
    """Every process in one container (its mount namespace is the container's identity)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and mount_namespace_of(int(entry)) == mount_namespace:
            found.append(int(entry))
    return found


def kill_all(mount_namespace: str | None) -> None:
    if mount_namespace is None:
        return
    for pid in processes_in(mount_namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def kill_container(container: ContainerState) -> None:
    """SIGKILL every process of the container, its main process first (which is known even
    when its namespace could not be read, e.g. it died while starting)."""
    if container.process is not None and container.process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(container.process.pid, signal.SIGKILL)
    kill_all(container.mount_namespace)


def release(container: ContainerState) -> None:
    if container.namespace_fd is not None:
        os.close(container.namespace_fd)
    container.namespace_fd = container.mount_namespace = None


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) references to variables defined earlier; $$(VAR) escapes."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0).startswith("$$"):
            return match.group(0)[1:]
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", replace, value)


@dataclass
class ContainerState:
    spec: dict[str, Any]
    restart_count: int = 0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    done: bool = False  # ended and will not be restarted
    # The container's identity: its mount namespace, pinned by an open descriptor so that its
    # number cannot be handed to a newer container while this one is being cleaned up.
    mount_namespace: str | None = None
    namespace_fd: int | None = None
    process: asyncio.subprocess.Process | None = None
    execution: Execution | None = None
    kill_reason: str | None = None
    # The last probe checks (monotonic time, kind, passed): what a flaky probe test prints.
    probe_log: collections.deque = field(default_factory=lambda: collections.deque(maxlen=24))

    @property
    def name(self) -> str:
        return self.spec["name"]

    def status(self) -> dict[str, Any]:
        status = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
        }
        if self.last_state:
            status["lastState"] = self.last_state
        return status


@dataclass
class PodRuntime:
    uid: str
    namespace: str
    name: str
    pod: dict[str, Any]
    root: Path
    interface: pod_network.PodInterface | None = None
    containers: list[ContainerState] = field(default_factory=list)
    init_containers: list[ContainerState] = field(default_factory=list)  # run one by one, first
    initialized: bool = False
    phase: str = "Pending"
    started_at: str = field(default_factory=now)
    waiting: tuple[str, str] | None = None  # pod-level (reason, message) while it cannot start
    deletion: asyncio.Event = field(default_factory=asyncio.Event)
    removed: asyncio.Event = field(default_factory=asyncio.Event)  # gone from the API already
    task: asyncio.Task[None] | None = None
    hosts_file: Path | None = None
    lost: bool = False  # its node stopped answering: killed at once, its deletion never confirmed

    @property
    def labels(self) -> dict[str, str]:
        return self.pod["metadata"].get("labels") or {}

    @property
    def spec(self) -> dict[str, Any]:
        return self.pod["spec"]

    @property
    def ip(self) -> str | None:
        return self.interface.ip if self.interface else None

    @property
    def node(self) -> str | None:
        return self.spec.get("nodeName")

    @property
    def hostname(self) -> str:
        return (self.spec.get("hostname") or self.name)[:63]

    @property
    def ready(self) -> bool:
        return self.phase == "Running" and all(c.ready for c in self.containers)

    def container(self, name: str) -> ContainerState:
        return next(c for c in self.containers if c.name == name)
