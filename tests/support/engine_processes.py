"""Watching engine worker processes from a test: find them, wait for them, bound every wait."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

# The engine's own answer, re-exported for the tests: one rule for whether a process lives.
from berth.engine.executor.processes import pid_alive as pid_alive

WORKER_MODULE = "berth.engine.executor.worker"
POSTPROCESS_MODULE = "berth.engine.executor.postprocess_worker"


def worker_pids(parent: int | None = None, module: str = WORKER_MODULE) -> list[int]:
    """Live worker processes (`module`: engine workers, or postprocess workers) whose parent is
    `parent` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if int(fields[1]) == parent and f"-m {module} " in cmdline and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def call_with_timeout(function: Callable[[], object], timeout: float) -> object:
    """`function()` on a daemon thread: its value or its exception, or TimeoutError (the thread
    is then abandoned, so a hung call fails the test instead of hanging it)."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"still running after {timeout} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def world_processes(parent: int | None = None) -> list[psutil.Process]:
    """The live processes of the worlds `parent` (default: this process) started, wherever they
    are in the process tree: mpiexec and every rank (ranks are mpiexec's grandchildren, and
    orphans of nobody once it is gone), found by the `--parent-pid` on their command line."""
    parent = os.getpid() if parent is None else parent
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = process.info["cmdline"] or []
        if process.info["status"] == psutil.STATUS_ZOMBIE or WORKER_MODULE not in cmdline:
            continue
        if any(a == "--parent-pid" and b == str(parent) for a, b in itertools.pairwise(cmdline)):
            found.append(process)
    return found


def no_world_outlives(parent: int | None = None, timeout: float = 10) -> None:
    """Fails (after killing them) if processes of `parent`'s worlds are still running after
    `timeout` seconds."""
    wait_until(lambda: not world_processes(parent), timeout=timeout, interval=0.1)
    leftovers = world_processes(parent)
    for process in leftovers:
        with contextlib.suppress(psutil.Error):
            process.kill()
    described = [(p.pid, p.info["cmdline"][:3]) for p in leftovers]
    assert not leftovers, f"world processes left running: {described}"
