"""Watching engine worker processes from a test: find them, wait for them, bound every wait."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

WORKER_MODULE = "berth.engine.executor.worker"


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (an exited, unreaped process counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def worker_pids(parent: int | None = None) -> list[int]:
    """Live worker processes whose parent is `parent` (default: this process)."""
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
        if int(fields[1]) == parent and WORKER_MODULE in cmdline and fields[0] not in ("Z", "X"):
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
