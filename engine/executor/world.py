"""How the proxy starts its worker world: one worker process, or an MPI world of ranks.

    LocalWorker   tensor_parallel_size 1: one worker process on this machine.
    MpiWorld      tensor_parallel_size N: N ranks started by mpich's `mpiexec` (hydra), on this
                  machine, or with a hostfile on the hosts it names, reached through the
                  launcher agent (ssh to the worker pods: `berth launch`'s shape).

Either way the world is one process the proxy starts and watches (the worker, or mpiexec):
when it ends, the world has ended. mpiexec ends the whole world when any rank dies (hydra
kills the others) and ends every rank when it is killed itself (each host's hydra proxy
loses its connection to it and kills its ranks), so one world has one fate.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import deque
from dataclasses import dataclass

# How many lines of mpiexec's output are kept for a dead world's error (hydra's verdict is at the end).
LAST_WORDS_LINES = 40
HYDRA_VERDICT = "TERMINATED WITH THE EXIT STRING:"
HYDRA_BAD_TERMINATION = "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"


@dataclass(frozen=True)
class LocalWorker:
    """One worker process (tensor_parallel_size 1)."""

    size: int = 1
    is_local: bool = True

    def command(self, worker_argv: list[str]) -> list[str]:
        return worker_argv

    def describe(self, pid: int) -> str:
        return f"the worker process {pid}"


@dataclass(frozen=True)
class MpiWorld:
    """`size` ranks started by mpiexec.

    Without a hostfile they run on this machine. With one (`HOST[:SLOTS]` per line, as the
    operator writes it), mpiexec places them on those hosts, slot by slot, and starts them
    through `launcher_agent` (an ssh-like program: `AGENT [-x] HOST COMMAND...`; mpich runs
    hosts that are this machine itself without it). `launcher_host` is the name under which
    the hosts reach this machine (mpich's `-localhost`): their hydra proxies connect back to
    it, and rank 0 connects to the proxy's queues there.
    """

    size: int
    hostfile: str | None = None
    launcher_agent: str | None = None
    launcher_host: str | None = None

    @property
    def is_local(self) -> bool:
        return self.hostfile is None

    def command(self, worker_argv: list[str]) -> list[str]:
        mpiexec = shutil.which("mpiexec")
        if mpiexec is None:
            raise RuntimeError(
                "tensor parallelism needs mpich's mpiexec on PATH (pip install 'berth[mpi]'; with a venv, "
                "put its bin/ on PATH)"
            )
        # hydra forwards this process's whole environment to every rank (the engine's key
        # too), over its own connection, never on a command line: ranks started over ssh get
        # the launcher's environment, not the ssh session's.
        command = [mpiexec, "-n", str(self.size)]
        if self.hostfile is not None:
            command += ["-f", self.hostfile]
        if self.launcher_agent is not None:
            command += ["-launcher", "ssh", "-launcher-exec", self.launcher_agent]
        if self.launcher_host is not None:
            command += ["-localhost", self.launcher_host]
        return command + worker_argv

    def describe(self, pid: int) -> str:
        return f"the MPI world of {self.size} ranks (mpiexec, pid {pid})"


World = LocalWorker | MpiWorld


class OutputTail:
    """Copies a world's output (mpiexec's: every rank's) to this process's stderr line by line,
    and keeps the last lines: when the world dies, hydra's verdict is in them."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.lines: deque[str] = deque(maxlen=LAST_WORDS_LINES)

    def copy(self) -> None:
        for raw in iter(self._stream.readline, b""):
            line = raw.decode(errors="replace")
            self.lines.append(line.rstrip())
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):  # stderr closed (the interpreter is exiting): keep reading
                pass
        self._stream.close()

    def last_words(self) -> str:
        """hydra's verdict on a rank that ended the world, else the last line that says
        something. The verdict is a framed block: "... TERMINATED WITH THE EXIT STRING: Killed
        (signal 9)" for a rank on this machine; "PID p / RUNNING AT host / EXIT CODE: c" lines
        for a rank that a remote host's proxy reported."""
        lines = list(self.lines)
        for line in reversed(lines):
            if HYDRA_VERDICT in line:
                return f"a rank ended: {line.split(HYDRA_VERDICT, 1)[1].strip()}"
        starts = [i for i, line in enumerate(lines) if HYDRA_BAD_TERMINATION in line]
        if starts:
            block = " ".join(lines[starts[-1] : starts[-1] + 4])
            code, where = (
                re.search(r"EXIT CODE: (\S+)", block),
                re.search(r"PID (\d+) RUNNING AT (\S+)", block),
            )
            if code:
                return f"a rank ended with exit code {code[1]}" + (
                    f" (pid {where[1]} on {where[2]})" if where else ""
                )
        said = [line.strip() for line in self.lines if line.strip().strip("=").strip()]
        return said[-1] if said else ""


def popen(
    world: World, worker_argv: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen, OutputTail | None]:
    """Starts the world; for an MPI world, also the tail of its output (to copy from a thread)."""
    if isinstance(world, LocalWorker):
        return subprocess.Popen(world.command(worker_argv), env=env, stdin=subprocess.DEVNULL), None
    process = subprocess.Popen(
        world.command(worker_argv),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # Its own session: a Ctrl-C at the terminal reaches the proxy, which shuts the world down
        # in order, and not mpiexec, which would kill every rank at once.
        start_new_session=True,
    )
    return process, OutputTail(process.stdout)
