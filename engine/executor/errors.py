"""The two kinds of failure: one request's (`RequestError`, which crosses the engine's boundary
and so lives in `engine_io`), and the engine's."""

from __future__ import annotations

import signal

from berth.engine.engine_io import EngineStalledError, RequestError

__all__ = [
    "EngineDeadError",
    "EngineStalledError",
    "EngineUnreachableError",
    "RemoteTraceback",
    "RequestError",
    "WorkerDiedError",
    "how_it_exited",
]


class EngineDeadError(RuntimeError):
    """The engine has died: no request can complete. Every pending and later request gets this."""


class EngineUnreachableError(EngineDeadError):
    """An attached frontend has lost (or cannot get) the engine it serves: its owner is gone,
    unreachable, or refuses it. For this frontend the engine is dead until it attaches again,
    which it keeps trying to by itself."""


class WorkerDiedError(RuntimeError):
    """A worker process exited while the engine still needed it (killed, crashed, out of memory)."""


def how_it_exited(returncode: int) -> str:
    """A process's end in words: `killed by signal 9 (SIGKILL)` reads better than code -9."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            return f"was killed by signal {-returncode}"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


class RemoteTraceback(Exception):
    """Where an error raised in a worker process came from: attached as its `__cause__`."""

    def __init__(self, traceback: str) -> None:
        super().__init__(traceback)
        self.traceback = traceback

    def __str__(self) -> str:
        return f"\n\nin the worker process:\n{self.traceback}"
