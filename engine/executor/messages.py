"""What the proxy and the worker say to each other, queue by queue.

Plain data only: a message is pickled on one side and unpickled on the other (after its
signature is checked), so nothing here may hold a socket, a lock or a thread.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from berth.engine.executor.response import Response

# ---- init status queue (worker <-> proxy) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """Sent first, before the slow model load, so the proxy can watch the process from then on."""

    rank: int
    pid: int
    host: str
    request_address: str  # where this rank listens for requests (the real port, if it picked one)


@dataclass(frozen=True, slots=True)
class WorkerReady:
    stats: object  # the engine's EngineStats right after loading


@dataclass(frozen=True, slots=True)
class InitFailed:
    error: BaseException
    traceback: str


@dataclass(frozen=True, slots=True)
class Ack:
    """The proxy's answer to READY: from now on it routes results."""


# The proxy answers a WorkerIdentity with the EngineConfig itself: the config is the ACK.

# ---- request queue (proxy -> rank 0) ----------------------------------------------------------
# A GenerationRequest travels as itself; aborts and control messages ride the same queue, so an
# abort can never overtake the request it cancels.


@dataclass(frozen=True, slots=True)
class AbortRequest:
    client_id: int
    seq_index: int | None = None


@dataclass(frozen=True, slots=True)
class ShutdownWorker:
    """The sentinel: abort what is in flight, answer it, say goodbye, exit."""


# ---- result queue (rank 0 -> proxy) -----------------------------------------------------------


@dataclass(slots=True)
class StepResults:
    """Every response of one engine step (all clients together), with the engine's stats."""

    responses: list[Response]
    stats: object


@dataclass(frozen=True, slots=True)
class WorkerFatal:
    """The engine loop died: the root cause, sent before the process exits."""

    error: BaseException
    traceback: str


@dataclass(frozen=True, slots=True)
class WorkerClosed:
    """The last message of a worker that shut down cleanly: every result has been sent."""


def portable_error(error: BaseException) -> BaseException:
    """`error` itself if it survives pickling both ways, else a RuntimeError naming it.

    Many exception classes cannot be rebuilt from their pickle (their __init__ takes other
    arguments); finding that out on the proxy would lose the root cause.
    """
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
