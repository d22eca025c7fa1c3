"""A memory cgroup for a test's processes, with a limit, always removed afterwards.

cgroup v2 where the machine has it (a child of the hierarchy's root, whose `memory`
controller must be enabled for children), else cgroup v1's `memory` controller. Needs root,
as the whole suite does. Processes join it as they start (`join` as a Popen `preexec_fn`), so
their children (an engine's worker) are in it too; on exit every process still in it is
killed and the cgroup removed, whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

from tests.support.engine_processes import wait_until

CGROUP = Path("/sys/fs/cgroup")


class MemoryCgroup:
    def __init__(self, path: Path, v2: bool) -> None:
        self.path = path
        self.v2 = v2

    def set_limit(self, limit_bytes: int) -> None:
        (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(limit_bytes))

    @property
    def limit(self) -> int:
        text = (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).read_text().strip()
        return int(text) if text != "max" else 1 << 63

    @property
    def pids(self) -> list[int]:
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]

    @property
    def oom_kills(self) -> int:
        """Processes the kernel killed for this cgroup's limit."""
        events = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        counts = dict(line.split() for line in events.splitlines() if line.strip())
        return int(counts.get("oom_kill", 0))

    def join(self) -> None:
        """Moves the calling process in (a `preexec_fn`: runs in the child before it execs)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def kill_all(self, timeout: float = 15) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not wait_until(lambda: not self.pids, timeout, interval=0.05):
            raise RuntimeError(f"processes {self.pids} outlived SIGKILL in {self.path}")


def _hierarchy() -> tuple[Path, bool]:
    if (CGROUP / "cgroup.controllers").is_file():  # the unified hierarchy is mounted here
        if "memory" not in (CGROUP / "cgroup.subtree_control").read_text().split():
            raise RuntimeError(f"cgroup v2 without the memory controller enabled in {CGROUP}")
        return CGROUP, True
    if (CGROUP / "memory" / "memory.limit_in_bytes").is_file():
        return CGROUP / "memory", False
    raise RuntimeError(f"no memory cgroup controller under {CGROUP} (neither v2 nor v1)")


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[MemoryCgroup]:
    if os.geteuid() != 0:
        raise RuntimeError("a memory cgroup needs root (the suite runs as root)")
    root, v2 = _hierarchy()
    path = root / f"berth-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    cgroup = MemoryCgroup(path, v2)
    try:
        cgroup.set_limit(limit_bytes)
        yield cgroup
    finally:
        try:
            cgroup.kill_all()
        finally:
            # rmdir succeeds once the last process is gone and the kernel has let go of it.
            wait_until(lambda: _try_rmdir(path), 15, interval=0.1)
            if path.exists():
                raise RuntimeError(f"could not remove the test cgroup {path}")


def _try_rmdir(path: Path) -> bool:
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
