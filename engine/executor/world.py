"""The proxy's worker world: how it starts (one worker process, or an MPI world of ranks), and the
processes of a started one (`RunningWorld`): watched, described when they end, killed.

    LocalWorker   tensor_parallel_size 1: one worker process on this machine.
    MpiWorld      tensor_parallel_size N: N ranks started by mpich's `mpiexec` (hydra), on this
                  machine, or with a hostfile on the hosts it names, reached through the
                  launcher agent (ssh to the worker pods: `berth launch`'s shape).
    RunningWorld  a started world: its process, its output, its ranks (as rank 0 names them).

Either way the world is one process the proxy starts and watches (the worker, or mpiexec):
when it ends, the world has ended. mpiexec ends the whole world when any rank dies (hydra
kills the others) and ends every rank when it is killed itself (each host's hydra proxy
loses its connection to it and kills its ranks), so one world has one fate.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass

from berth.engine.executor.errors import how_it_exited
from berth.engine.executor.processes import pid_alive, process_state

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


class RunningWorld:
    """A started world: the one process the proxy started (the worker, or mpiexec: its exit is
    the world's end), the tail of its output (an MPI world's), and its ranks once rank 0 has
    named them (`ranks`: (rank, pid, host), sent before the slow model load)."""

    def __init__(self, world: World, worker_argv: list[str], env: dict[str, str]) -> None:
        self.world = world
        self.process, self._output = popen(world, worker_argv, env)
        self.ranks: tuple[tuple[int, int, str], ...] = ()
        self.gone = threading.Event()  # set once the process has exited (`wait`)
        self._copier: threading.Thread | None = None
        if self._output is not None:
            self._copier = threading.Thread(target=self._output.copy, name="berth-world-output", daemon=True)
            self._copier.start()

    def wait(self) -> int:
        """Blocks until the world's process exits; its exit code."""
        code = self.process.wait()
        self.gone.set()
        return code

    def how_it_ended(self, last_words_seconds: float) -> str:
        """How the world ended, in words: for an MPI world with mpiexec's last words, which say
        what became of the ranks (hydra names the exit code or signal of the one that ended)."""
        said = f"{self.world.describe(self.process.pid)} {how_it_exited(self.process.returncode)}"
        if self._copier is not None:
            self._copier.join(last_words_seconds)  # what it wrote before it exited
            if last := self._output.last_words():
                said += f" ({last})"
        return said

    def local_ranks(self) -> list[tuple[int, int]]:
        """(rank, pid) of every rank on this machine, as rank 0 named them."""
        here = socket.gethostname()
        return [(rank, pid) for rank, pid, host in self.ranks if host == here]

    def gone_rank(self) -> str | None:
        """A rank on this machine whose process is gone, in words (the polling backstop of a
        death the process's exit has not shown yet); None while every one lives."""
        for rank, pid in self.local_ranks():
            if pid == self.process.pid:
                continue  # the world's own process: its watcher (`wait`) says how it ended, signal and all
            if not pid_alive(pid):
                if self.world.size > 1:
                    return f"rank {rank}'s process {pid} of {self.world.describe(self.process.pid)} is gone"
                return f"the worker process {pid} is gone"
        return None

    def stuck_ranks(self) -> str:
        """Which ranks on this machine are not running (stopped, in uninterruptible sleep, gone),
        from their process state, for a stall's message."""
        stuck = [
            f"rank {rank} (pid {pid}) {how}"
            for rank, pid in self.local_ranks()
            if (how := process_state(pid)) is not None
        ]
        return "; ".join(stuck)

    def kill(self, timeout: float) -> None:
        """Kills the world: its process (waiting up to `timeout` for its exit to be seen) and every
        rank on this machine. mpiexec's hydra proxies end their ranks when it dies; ranks here are
        not left to that alone (one that hangs in a collective would go on holding the model)."""
        if self.process.poll() is None:
            self.process.kill()
            self.gone.wait(timeout)
        if isinstance(self.world, MpiWorld):
            for _, pid in self.local_ranks():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
