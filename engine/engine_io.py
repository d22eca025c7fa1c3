"""What crosses the engine's boundary, both ways: the request that goes in, the messages that
ride with it, the responses and stats that come out, the engine's limits, and the error that
fails one request.

A leaf: `executor/` (which sends these) and `pyexecutor/` (which consumes and produces them)
both import it, and it imports nothing of the engine's rooms but `SamplingParams` and the
disaggregated request types (`disaggregation`). Everything
here is plain data: it is pickled on one side of a process boundary and unpickled on the other.

One id names a request end to end: `request_id`, assigned by the executor when it is
submitted, carried by the engine's sequences and by every response. It is unique within one
engine (an attach frontend will keep its own id in the high bits, so ids never collide).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from berth.engine.disaggregation import Disaggregated, KVHandle, check_disaggregated
from berth.engine.sampling_params import SamplingParams

# The seed's rule, measured in UTF-8 bytes (what is hashed), not code points.
MAX_CACHE_SALT_BYTES = 256


class TransitionError(RuntimeError):
    """A sleep or wakeup the engine refused; it is left exactly as it was (in `admission`).

    `code`: "conflict" (the engine is not in the state the transition starts from: another
    transition runs, or it already sleeps / is awake; HTTP 409), "invalid_model" (a wakeup's
    new model cannot be served by this engine: missing, unreadable, other shapes; HTTP 400),
    "invalid_request" (a parameter out of range; HTTP 400), "not_engine_owner" (asked of an
    attached frontend: sleep and wakeup are the owner's to do; HTTP 403).
    """

    def __init__(self, message: str, code: str = "conflict", admission: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.admission = admission

    def __reduce__(self):
        return (type(self), (str(self), self.code, self.admission))


class RequestError(RuntimeError):
    """Fails one request; the engine goes on serving the others.

    `code` says what kind of problem it is, so a server can answer with the right status:
    "invalid_request" (bad input), "too_long" (can never fit the model or the KV cache),
    "admission_closed" (the engine is not admitting requests now: sleeping, draining, stopped),
    "internal" (the engine failed on this request alone; nothing the client can fix).
    `param` names the request field at fault when there is one ("prompt", "max_tokens", ...).
    `stage` says where an "internal" failure happened ("admission", "sampling", "postprocess"):
    servers count them by it.
    """

    def __init__(
        self,
        message: str,
        code: str = "invalid_request",
        param: str | None = None,
        stage: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
        self.stage = stage

    def __reduce__(self):  # keep `code`, `param` and `stage` across pickling (errors cross processes)
        return (type(self), (str(self), self.code, self.param, self.stage))


def internal_error(stage: str) -> RequestError:
    """An unexpected failure that belongs to one request (the caller logs its traceback). Its
    message is the log's pointer: clients learn that it failed, not how berth is built."""
    return RequestError(
        f"berth failed on this request ({stage}); see the server's log", "internal", stage=stage
    )


@dataclass(frozen=True, slots=True)
class LoadProgress:
    """How far the engine's start has come, reported while it loads (rank 0's view): `step` is
    "loading weights" (`done` / `total` bytes read), "sizing the KV cache" (the profiled step),
    "capturing decode graphs" (on a GPU), or "checking the model" (one token through every
    rank)."""

    step: str
    done: int = 0
    total: int = 0

    @property
    def fraction(self) -> float | None:
        return self.done / self.total if self.total else None

    def describe(self) -> str:
        if self.total:
            return f"{self.step}: {100 * self.done / self.total:.0f}% of {self.total / 2**20:.1f} MiB"
        return self.step


ProgressSink = Callable[[LoadProgress], None]


class EngineStalledError(RuntimeError):
    """The engine had work and made no progress in time: a step, or a collective inside one, did
    not complete (a stopped or wedged rank, a hung device). The engine is dead for good: one that
    resumes later is not trusted again (its world is restarted)."""


# ---- into the engine ---------------------------------------------------------------------------


@dataclass
class GenerationRequest:
    """What the engine needs to run one request.

    Prompt token ids travel as one int32 buffer, whatever the caller passed: a 32k-token
    prompt is then one 128 KB array on the wire, not 32k Python ints to pickle.
    `cache_salt` isolates prefix-cache reuse: requests share cached KV blocks only when their
    salts are equal (None is a salt of its own), so tenants with different salts share nothing.
    """

    prompt_token_ids: np.ndarray
    sampling_params: SamplingParams
    streaming: bool = False
    priority: float = 0.5
    arrival_time: float = field(default_factory=time.time)
    cache_salt: str | None = None
    request_id: int = -1  # assigned by the executor when submitted
    disaggregated: Disaggregated | None = None  # ContextOnly() or GenerationOnly(handle)

    def __post_init__(self) -> None:
        self.prompt_token_ids = as_token_buffer(self.prompt_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the field at fault. Run where the request is built and
        again where the engine receives it: an unpickled request never ran __post_init__."""
        tokens = self.prompt_token_ids
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype != np.int32:
            raise ValueError("prompt token ids must be a one-dimensional int32 array")
        if tokens.size == 0:
            raise ValueError("prompt must contain at least one token")
        if tokens.min() < 0:
            raise ValueError("prompt token ids must be non-negative 32-bit integers")
        # `not (0 <= p <= 1)` is also true for NaN: reject it here, not deep in a heap.
        if not _is_number(self.priority) or not (0.0 <= self.priority <= 1.0):
            raise ValueError(f"priority must be a number in [0, 1], got {self.priority!r}")
        if not isinstance(self.streaming, bool):
            raise ValueError(f"streaming must be a bool, got {self.streaming!r}")
        if not _is_number(self.arrival_time):
            raise ValueError(f"arrival_time must be a finite number, got {self.arrival_time!r}")
        check_cache_salt(self.cache_salt)
        check_disaggregated(self.disaggregated)
        if not isinstance(self.sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(self.sampling_params)}")
        self.sampling_params.validate()


def check_cache_salt(salt: object) -> None:
    """None, or a non-empty string of at most MAX_CACHE_SALT_BYTES bytes in UTF-8."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    try:
        size = len(salt.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: not text, and not hashable as text
        raise ValueError("cache_salt must be valid Unicode text (it has a lone surrogate)") from None
    if size > MAX_CACHE_SALT_BYTES:
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes in UTF-8, got {size}")


def as_token_buffer(token_ids) -> np.ndarray:
    """A 1-D C-contiguous int32 array of non-negative token ids."""
    if hasattr(token_ids, "detach"):  # torch.Tensor, without importing torch here
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, (list, tuple)) and any(isinstance(t, bool) for t in token_ids):
        raise ValueError("prompt token ids must be integers, got a bool")
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"prompt token ids must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"prompt token ids must be integers, got {array.dtype}")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        raise ValueError("prompt token ids must be non-negative 32-bit integers")
    return np.ascontiguousarray(array, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stops a request's sequences (all of them, or the one `seq_index` names). It rides the
    same ordered queue as the requests, so it can never overtake the request it cancels."""

    request_id: int
    seq_index: int | None = None


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The sentinel: the engine aborts what is in flight, answers it, and stops."""


SLEEP_LEVELS = (1, 2)
SLEEP_MODES = ("drain", "abort")
DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds in-flight requests may take to finish before a sleep aborts them


@dataclass(frozen=True, slots=True)
class Sleep:
    """RUNNING -> PARKING -> PARKED. Admission closes when it is queued; what is in flight
    drains (`mode="drain"`, for at most `drain_timeout` seconds, then the rest is aborted) or is
    aborted at once (`mode="abort"`); then memory is released: level 1 frees the KV cache and
    moves the weights to host memory (on a CPU they are there already), level 2 drops the
    weights too (a wakeup reloads them from the model directory)."""

    level: int = 1
    mode: str = "drain"
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    transition_id: int = -1  # assigned by the executor, like a request's id

    @property
    def kind(self) -> str:
        return "sleep"

    def validate(self) -> None:
        if isinstance(self.level, bool) or not isinstance(self.level, int) or self.level not in SLEEP_LEVELS:
            raise ValueError(f"level must be 1 or 2, got {self.level!r}")
        if self.mode not in SLEEP_MODES:
            raise ValueError(f"mode must be one of {SLEEP_MODES}, got {self.mode!r}")
        if not _is_number(self.drain_timeout) or self.drain_timeout < 0:
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {self.drain_timeout!r}")


@dataclass(frozen=True, slots=True)
class Wakeup:
    """PARKED -> WAKING -> RUNNING: memory is restored and admission reopens. `model`, a model
    directory (on the engine's machine), swaps in new weights of the same architecture and
    shapes in the same processes; a model that does not fit is refused and the engine stays
    PARKED, able to wake with the weights it had."""

    model: str | None = None
    transition_id: int = -1

    @property
    def kind(self) -> str:
        return "wakeup"

    def validate(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be a non-empty path or None, got {self.model!r}")


Control = Sleep | Wakeup


# ---- out of the engine ---------------------------------------------------------------------------

# One generated token's log-probability and the top alternatives at its position:
# (logprob of the sampled token, its rank in the vocabulary, [(token_id, logprob), ...]).
TokenLogprobs = tuple[float, int, list[tuple[int, float]]]


@dataclass(slots=True)
class Response:
    """What the engine sends back for one sequence of one request in one step."""

    request_id: int
    seq_index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # The stop token id that ended the sequence; for an abort the engine decided, why (text).
    stop_reason: int | str | None = None
    error: RequestError | None = None  # the whole request failed
    queue_seconds: float | None = None  # on a sequence's first response: arrival -> first scheduled
    kv_handle: KVHandle | None = None  # a context-only request's, on its last response
    # On a sequence's first response: prompt tokens the prefix cache held when it was admitted.
    num_cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ModelRevision:
    """Which weights serve: the model directory and a digest of what is in it (see
    `berth.engine.models.loader.checkpoint_digest`)."""

    path: str
    digest: str

    def __str__(self) -> str:
        return f"{self.path}@{self.digest[:19]}"


@dataclass(frozen=True, slots=True)
class EngineMemory:
    """What the engine (rank 0's process) holds, measured, not planned. `kv_cache_bytes` and
    `weight_bytes` are on the engine's device (weights moved to host memory by a level-1 sleep
    on a GPU do not count); `resident_bytes` is the process's RSS; `device_allocated_bytes` is
    torch's CUDA allocator's count (None on a CPU)."""

    device: str
    kv_cache_bytes: int
    weight_bytes: int
    resident_bytes: int
    device_allocated_bytes: int | None = None


GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """The KV pool's size, and what it was sized from (reported by /admin/state and /metrics)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    dtype: str
    # The limit applied and where it came from: "cgroup", "host", "cuda" (its capacity), or
    # "flag" (kv_cache_memory / kv_cache_blocks: the bytes asked for, checked to fit the others).
    limit_source: str
    limit_bytes: int
    available_bytes: int  # free under the tightest measured limit once the weights were loaded
    activation_peak_bytes: int
    headroom_bytes: int

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """The line `berth serve` logs at start."""
        return (
            f"KV cache: {self.num_blocks} blocks = {self.pool_bytes / GiB:.2f} GiB ({self.num_tokens} "
            f"tokens of context), limit {self.limit_bytes / GiB:.2f} GiB from {self.limit_source} "
            f"({self.dtype}, {self.bytes_per_token} bytes per token)"
        )


@dataclass(slots=True)
class EngineStats:
    """A snapshot taken after every step that answered someone (for /metrics, /admin/state).

    Counters (`num_preemptions`, `prefix_cache_*`, `num_computed_tokens`) count since start.
    `timestamp` is the engine's wall clock when the snapshot was taken: the time of the step
    whose responses it travels with. `seq` orders the snapshots: one more for each the engine
    takes. Snapshots reach a client by several ways (steps, transitions, each postprocess
    worker's lane, heartbeats), each in its own order: the highest `seq` is the latest, whatever
    the wall clock did in between (a clock stepped back must not make fresh stats look stale).
    """

    num_running: int
    num_waiting: int
    kv_blocks_used: int  # held by running sequences
    kv_blocks_total: int
    admission: str
    kv_blocks_cached: int = 0  # holding a reusable prefix (in use or free, until evicted)
    num_preemptions: int = 0  # a sign the KV pool is too small for the load
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (not computed again)
    num_computed_tokens: int = 0  # tokens the model has run, prefill and decode
    num_steps: int = 0  # forward passes
    # Tensor parallelism (zero with one rank): the all-reduces of the forward passes, and the
    # time rank 0 spent in them and in the other collectives (the step broadcast, the logits
    # gather), waiting for the slowest rank included. Measured on the CPU only.
    num_all_reduces: int = 0
    all_reduce_seconds: float = 0.0
    other_collective_seconds: float = 0.0
    timestamp: float = 0.0
    # Sleep and wakeup: when `admission` was entered (wall clock), the level slept at (0 while
    # awake), the device memory held, the weights serving, and transitions since start by the
    # state they reached ("parking", "parked", "waking", "running", "failed").
    admission_since: float = 0.0
    sleep_level: int = 0
    kv_cache_bytes: int = 0
    weight_bytes: int = 0
    model_revision: ModelRevision | None = None
    transitions: dict[str, int] = field(default_factory=dict)
    resident_bytes: int = 0  # the engine process's RSS (rank 0's), read when the snapshot was taken
    seq: int = 0

    @classmethod
    def of_dead_engine(cls, kv_blocks_total: int) -> EngineStats:
        """What a dead engine holds: nothing running, nothing waiting, no blocks."""
        return cls(0, 0, 0, kv_blocks_total, "failed", timestamp=time.time())


@dataclass(slots=True)
class TransitionResult:
    """How one sleep or wakeup ended, sent back to whoever asked for it.

    `error` set: refused, nothing changed (the engine is in `admission`). Otherwise the engine
    reached `admission` ("parked" after a sleep, "running" after a wakeup) in `seconds` (from
    the engine's taking it up, drain included), aborting `num_aborted` requests on the way.
    A transition that fails half-way is no result: the engine is dead, and the asker gets
    EngineDeadError.
    """

    transition_id: int
    kind: str  # "sleep" | "wakeup"
    admission: str
    error: TransitionError | None = None
    seconds: float = 0.0
    drain_seconds: float = 0.0
    num_aborted: int = 0
    memory_before: EngineMemory | None = None
    memory_after: EngineMemory | None = None
    model_revision: ModelRevision | None = None
    stats: EngineStats | None = None  # the engine's, right after (None for a refusal)


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What the engine can serve, reported once (in its READY message) and used by everyone who
    checks a request against it: the server (to name the parameter at fault) and the engine's
    own activation check (so a request that gets past the server, or never met one, fails
    alone instead of failing the engine). One rule for each limit, here."""

    max_model_len: int  # prompt + output tokens of one sequence
    vocab_size: int
    max_batch_size: int
    max_num_tokens: int  # tokens one step computes
    enable_chunked_prefill: bool
    kv_block_size: int
    num_kv_blocks: int
    kv_cache: KVCachePlan | None = None  # how the pool was sized (None: an engine built by hand)

    def check_prompt(self, token_ids: np.ndarray) -> None:
        if token_ids.size and int(token_ids.max()) >= self.vocab_size:
            bad = int(token_ids[token_ids >= self.vocab_size][0])
            raise RequestError(
                f"prompt token id {bad} is out of range for the vocabulary (size {self.vocab_size})",
                param="prompt",
            )

    def check_logit_bias(self, logit_bias: Iterable[int] | None) -> None:
        """A bias on a token the model does not have is a mistake (another model's ids), not a
        no-op: refused, as a prompt's would be."""
        outside = sorted(token for token in logit_bias or () if token >= self.vocab_size)
        if outside:
            raise RequestError(
                f"logit_bias token id {outside[0]} is out of range for the vocabulary "
                f"(size {self.vocab_size})",
                param="logit_bias",
            )

    def check_n(self, n: int) -> None:
        if n > self.max_batch_size:
            raise RequestError(
                f"n={n} exceeds max_batch_size={self.max_batch_size} (the n sequences of a request "
                "run in one batch)",
                param="n",
            )

    def output_budget(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The tokens a request may generate: `max_tokens`, or all the model's length leaves
        (None). A prompt must leave room for at least one token."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, the prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for a completion. Please shorten "
                "the prompt.",
                "too_long",
                "prompt",
            )
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                "too_long",
                "max_tokens",
            )
        return max_tokens

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.kv_block_size)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuses what can never run: a prompt too long for one step without chunking, or a
        sequence longer than the whole KV pool. A request's `n` sequences enter the batch
        together but take their blocks as they get them (sharing their prompt's blocks when
        prefix caching is on), so one sequence that fits is the whole condition."""
        if not self.enable_chunked_prefill and num_prompt_tokens > self.max_num_tokens:
            raise RequestError(
                f"prompt ({num_prompt_tokens} tokens) exceeds max_num_tokens={self.max_num_tokens} "
                "and chunked prefill is disabled",
                "too_long",
                "prompt",
            )
        # The last sampled token is never written to the cache.
        needed = self.blocks_for(num_prompt_tokens + max_tokens - 1)
        if needed > self.num_kv_blocks:
            raise RequestError(
                f"request can never fit in the KV cache: it needs {needed} blocks of "
                f"{self.kv_block_size} tokens (prompt {num_prompt_tokens} + max_tokens {max_tokens}) "
                f"but the pool holds {self.num_kv_blocks} blocks",
                "too_long",
                "max_tokens",
            )

    def check(self, request: GenerationRequest) -> int:
        """Every model- and pool-dependent check of one request; returns its output budget."""
        self.check_prompt(request.prompt_token_ids)
        self.check_n(request.sampling_params.n)
        self.check_logit_bias(request.sampling_params.logit_bias)
        num_prompt = int(request.prompt_token_ids.size)
        max_tokens = self.output_budget(num_prompt, request.sampling_params.max_tokens)
        self.check_fits(num_prompt, max_tokens)
        return max_tokens


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
