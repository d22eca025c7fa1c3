"""The two kinds of failure: one request's, and the engine's."""

from __future__ import annotations

import signal


class RequestError(RuntimeError):
    """Fails one request; the engine goes on serving the others.

    `code` says what kind of problem it is, so a server can answer with the right status:
    "invalid_request" (bad input), "too_long" (can never fit the model or the KV cache),
    "admission_closed" (the engine is not admitting requests now: sleeping, draining).
    """

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # keep `code` across pickling (errors cross process boundaries)
        return (type(self), (str(self), self.code))


class EngineDeadError(RuntimeError):
    """The engine has died: no request can complete. Every pending and later request gets this."""


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
