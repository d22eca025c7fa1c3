"""What the proxy and the worker say to each other, queue by queue.

Plain data only: a message is pickled on one side and unpickled on the other (after its
signature is checked), so nothing here may hold a socket, a lock or a thread.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from berth.engine.config import EngineConfig
from berth.engine.engine_io import EngineLimits, EngineStats, Response, Wakeup
from berth.engine.executor.postprocess import SequenceUpdate
from berth.engine.sampling_params import SamplingParams

# ---- init status queue (worker <-> proxy) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """Sent first, before the slow model load, so the proxy can watch the process from then on."""

    rank: int
    pid: int
    host: str
    request_address: str  # where this rank listens for requests (the real port, if it picked one)
    # (rank, pid, host) of every rank of the world, this one included: the proxy watches them all.
    world: tuple[tuple[int, int, str], ...] = ()


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """The model is loaded: what the engine can serve (said once, here) and its first stats."""

    limits: EngineLimits
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class InitFailed:
    error: BaseException
    traceback: str


@dataclass(frozen=True, slots=True)
class Ack:
    """The proxy's answer to READY: from now on it routes results."""


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """The proxy's answer to a WorkerIdentity: what to run, and where its results go."""

    config: EngineConfig
    # The postprocess workers' inputs: request r's responses go to lane r % len(lanes). Empty:
    # straight back to the proxy, raw.
    result_lanes: tuple[str, ...] = ()


# ---- request queue (proxy -> rank 0) ----------------------------------------------------------
# The engine's own inputs travel as themselves (`engine_io`): GenerationRequest, AbortRequest and
# the Shutdown sentinel, on one queue in one order, so an abort can never overtake its request.


@dataclass(frozen=True, slots=True)
class WakeupWithTokenizer:
    """A wakeup after which the postprocess workers detokenize with the tokenizer saved in
    `tokenizer_dir` (on their machine, the proxy's): the one the proxy swapped in for the
    revision the wakeup loads. Rank 0 passes it on only if the wakeup succeeds."""

    wakeup: Wakeup
    tokenizer_dir: str


# ---- result queue (rank 0 -> proxy) -----------------------------------------------------------


@dataclass(slots=True)
class StepResults:
    """Every response of one engine step (all clients together), with the engine's stats.

    Raw `Response`s from rank 0, or `SequenceUpdate`s when a postprocess worker handled them;
    from the engine's owner to a frontend, only that frontend's."""

    responses: list[Response | SequenceUpdate]
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class WorkerFatal:
    """The engine loop died: the root cause, sent before the process exits."""

    error: BaseException
    traceback: str


@dataclass(frozen=True, slots=True)
class WorkerClosed:
    """The last message of a worker that shut down cleanly: every result has been sent."""


# ---- lanes (rank 0 -> postprocess workers -> proxy) ----------------------------------------------


@dataclass(slots=True)
class LaneStep:
    """Rank 0 to one postprocess worker: its share of one engine step's responses, and the
    parameters of requests it has not seen yet, sent once, with a request's first response."""

    responses: list[Response]
    stats: EngineStats
    new_requests: dict[int, tuple[SamplingParams, bool]]  # request_id -> (params, streaming)


@dataclass(frozen=True, slots=True)
class LaneTokenizer:
    """Rank 0 to every postprocess worker, ahead of the result of a wakeup that swapped the
    model's tokenizer: detokenize with the one saved in `tokenizer_dir` from now on. Every
    response of a request admitted after the wakeup travels behind it on the same lane."""

    tokenizer_dir: str


@dataclass(frozen=True, slots=True)
class PostprocessReady:
    """A postprocess worker has its tokenizer and listens on `input_address`."""

    index: int
    pid: int
    input_address: str


# ---- attach queue (a frontend <-> the engine's owner) -------------------------------------------
# A frontend serves an engine another process owns. Requests and aborts go in, each frontend's
# results come back on its own connection (its lane), and news flows both ways: heartbeats, and
# the end of an attachment (the frontend closing, the engine dying or its owner stopping).

ATTACH_PROTOCOL = 1
# A frontend's id lives in the high bits of every request id it assigns: ids never collide in
# the engine, and the owner routes a response by its id alone. The owner's own are frontend 0.
FRONTEND_ID_SHIFT = 48
MAX_FRONTEND_ID = (1 << 15) - 1  # ids stay below 2**63: any int64 can hold one


def namespaced_request_id(frontend_id: int, number: int) -> int:
    if number >= 1 << FRONTEND_ID_SHIFT:
        raise OverflowError(f"frontend {frontend_id} has used all {1 << FRONTEND_ID_SHIFT} request ids")
    return (frontend_id << FRONTEND_ID_SHIFT) | number


def frontend_of(request_id: int) -> int:
    return request_id >> FRONTEND_ID_SHIFT


@dataclass(frozen=True, slots=True)
class AttachHello:
    protocol: int
    pid: int
    host: str


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a frontend needs to serve an engine it does not own, said once, at attach time."""

    limits: EngineLimits
    config: EngineConfig
    model_name: str  # the owner's served model name
    model_path: str
    tokenizer_files: dict[str, bytes]  # what `save_pretrained` writes: the owner's tokenizer, whole
    engine_pid: int


@dataclass(frozen=True, slots=True)
class AttachWelcome:
    frontend_id: int
    info: EngineInfo
    stats: EngineStats | None
    admission: str
    heartbeat_seconds: float  # how often each side speaks at least
    heartbeat_timeout: float  # silence after which the other side is taken for gone


@dataclass(frozen=True, slots=True)
class AttachRefused:
    reason: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Either way, at least every `heartbeat_seconds`; the owner's carry the engine's state."""

    stats: EngineStats | None = None
    admission: str | None = None


@dataclass(frozen=True, slots=True)
class Detach:
    """A frontend closing: the owner aborts its requests still in the engine."""


@dataclass(frozen=True, slots=True)
class AttachmentEnded:
    """The owner to a frontend: this attachment is over (the engine died, its owner is stopping,
    or it took the frontend for gone and aborted its requests). Attach again."""

    reason: str
    engine_dead: bool


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
