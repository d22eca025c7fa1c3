"""`GenerationExecutor`: the boundary between the LLM API and the engine.

It keeps the ledger of pending results, routes each step's responses to them from one
dispatch thread, and owns the failure semantics: a `RequestError` fails one request; a fatal
error is recorded once (the first wins), marks the engine dead, wakes every pending result
with `EngineDeadError` at once and refuses every later submit. Subclasses decide where the
engine runs (this process, or a worker process) and how messages get there.

Sleep and wakeup go the same way as requests: registered before they are sent, sent on the
same ordered queue, answered by a `TransitionResult` routed in the order the engine produced
it (after the responses of the requests a sleep ended), and failed with `EngineDeadError` if
the engine dies first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable

from berth.engine.engine_io import (
    DEFAULT_DRAIN_TIMEOUT,
    Control,
    EngineLimits,
    EngineStats,
    GenerationRequest,
    ModelRevision,
    RequestError,
    Response,
    Sleep,
    TransitionResult,
    Wakeup,
    internal_error,
)
from berth.engine.executor.errors import EngineDeadError
from berth.engine.executor.messages import frontend_of, namespaced_request_id
from berth.engine.executor.postprocess import SequenceUpdate
from berth.engine.executor.result import GenerationResult
from berth.engine.executor.stall_watchdog import StallWatchdog

logger = logging.getLogger(__name__)

# How long a caller waits for a transition past its deadline (`EngineConfig.transition_timeout`,
# after a sleep's drain): the stall watchdog declares the engine dead at the deadline, and this
# is only a backstop should that fail to answer the caller.
TRANSITION_GRACE = 30.0

# Another frontend's responses, by frontend id, with the stats of the step they came from.
ForeignSink = Callable[[dict[int, list[Response | SequenceUpdate]], EngineStats], None]


class GenerationExecutor(ABC):
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._results: dict[int, GenerationResult] = {}
        self._results_lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self._transitions: dict[int, _PendingTransition] = {}  # under _results_lock too
        self._transition_ids = itertools.count(1)
        # This process's namespace of request ids: 0 for the engine's owner, its own id for an
        # attached frontend. Responses in another namespace go to `foreign_sink`.
        self.frontend_id = 0
        self.foreign_sink: ForeignSink | None = None
        self._fatal_lock = threading.Lock()
        self._fatal_error: BaseException | None = None
        self._closed = False  # set when shutdown starts: admission stops there
        # Set when a drain before a shutdown starts (`stop_admission`): new requests, this
        # process's and every attached frontend's, are refused; those in flight run on.
        self._admission_stopped: str | None = None
        # Called with the new tokenizer by `replace_tokenizer`, before admission can reopen.
        self.tokenizer_listeners: list[Callable[[object], None]] = []
        self._shutdown_lock = threading.Lock()
        # What the engine runs and can serve, as it said once when it started (set by the subclass).
        self.config = None  # EngineConfig
        self.limits: EngineLimits | None = None
        self._stats: EngineStats | None = None  # the engine's latest, updated with every step
        # For the stall watchdog: when the engine last showed progress (a step, or no work left;
        # time.monotonic()), and the step count at its last load or wakeup.
        self.progress_at = time.monotonic()
        self._steps_at_start = 0

    # ---- what subclasses provide --------------------------------------------------------------

    @abstractmethod
    def _send_request(self, request: GenerationRequest) -> None: ...

    @abstractmethod
    def _send_abort(self, request_id: int, seq_index: int | None) -> None: ...

    @abstractmethod
    def _send_control(self, control: Control) -> None:
        """Sends a sleep or wakeup; may refuse it at once (TransitionError)."""

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abstractmethod
    def engine_pid(self) -> int:
        """The process id of the process that runs the engine (rank 0 of the world)."""

    @property
    def ranks(self) -> tuple[tuple[int, int, str], ...]:
        """(rank, pid, host) of every process of the engine's world."""
        return ((0, self.engine_pid, socket.gethostname()),)

    @abstractmethod
    def _engine_admission_state(self) -> str:
        """The live engine's admission state: "running", "parking", "parked" or "waking"."""

    def _watch_for_stalls(
        self, detail: Callable[[], str] = lambda: "", on_stall: Callable[[], None] = lambda: None
    ) -> None:
        """Starts the stall watchdog (see `stall_watchdog`), once the engine runs: only the
        engine's owner watches it (an attached frontend hears of a stall from the owner)."""
        StallWatchdog(self, self.config.stall_timeout, self.config.first_step_bound, detail, on_stall).start()

    def _check_workers(self) -> None:  # noqa: B027 (optional: only shapes with workers poll them)
        """Notices a dead worker without blocking (the polling backstop); may call `_set_fatal`."""

    # ---- the client's side --------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._fatal_error is not None

    @property
    def fatal_error(self) -> BaseException | None:
        return self._fatal_error

    @property
    def is_closed(self) -> bool:
        """True once shutdown has started (admission stops there)."""
        return self._closed

    @property
    def stats(self) -> EngineStats | None:
        """The engine's latest stats (None before its first report). A dead engine holds
        nothing: it reports no running or waiting request and no block in use."""
        if self.is_dead:
            return EngineStats.of_dead_engine(self.limits.num_kv_blocks if self.limits else 0)
        return self._stats

    @property
    def model_revision(self) -> ModelRevision | None:
        """The weights the engine serves (or served, once dead), as it last reported them."""
        return self._stats.model_revision if self._stats is not None else None

    @property
    def admission_state(self) -> str:
        """ "failed" once the engine is dead, "shutdown" once shutdown has started, else the
        engine's own state."""
        if self.is_dead:
            return "failed"
        if self._closed or self._admission_stopped is not None:
            return "shutdown"
        return self._engine_admission_state()

    def replace_tokenizer(self, tokenizer) -> None:
        """Serves with `tokenizer` from now on (a wakeup that swaps in a revision brings its own).
        Call it while the engine admits nothing (parked): once it returns, no request tokenized
        with the old one can be submitted (`submit`), and every `tokenizer_listeners` callback (an
        attach endpoint, whose frontends must attach again for it) has run."""
        with self._results_lock:  # submit checks and uses the tokenizer under it
            self.tokenizer = tokenizer
        for listener in list(self.tokenizer_listeners):
            listener(tokenizer)

    def stop_admission(self, reason: str = "the engine's owner is shutting down") -> None:
        """The drain before a shutdown: every new request is refused from now on (a
        RequestError "admission_closed" with `reason`), this process's and those every attached
        frontend forwards, and the admission state says "shutdown", which frontends follow;
        requests in flight run on. `shutdown()` ends them later."""
        self._admission_stopped = reason

    def submit(
        self, request: GenerationRequest, *, prompt: str | None = None, tokenized_with=None
    ) -> GenerationResult:
        """Sends `request`; its result detokenizes with the tokenizer serving now. `tokenized_with`:
        the tokenizer its prompt was tokenized with, if it was: a request tokenized with one that
        no longer serves (a wakeup swapped the model in between) is refused, to be sent again
        (a RequestError "admission_closed": the engine would read its tokens as other words)."""
        self._raise_if_closed()
        self._raise_unless_admitting()
        request.request_id = self._next_request_id()
        # Register before sending, so a response that comes back at once always has a home.
        with self._results_lock:
            if tokenized_with is not None and tokenized_with is not self.tokenizer:
                raise RequestError(
                    "the model's tokenizer changed while this request was being tokenized: send it again",
                    "admission_closed",
                )
            result = GenerationResult(request, tokenizer=self.tokenizer, prompt=prompt, abort=self.abort)
            self._results[request.request_id] = result
        try:
            # Checked again: a death or a shutdown since the first check fails everything it
            # finds registered, and may have missed this one.
            self._raise_if_closed()
            self._send_request(request)
        except BaseException:
            with self._results_lock:
                self._results.pop(request.request_id, None)
            raise
        return result

    def forward(self, request: GenerationRequest) -> None:
        """Sends a request another frontend submitted and keeps the result of (its id says
        which): its responses go to `foreign_sink`. Raises as `submit` does."""
        self._raise_if_closed()
        self._raise_unless_admitting()
        self._send_request(request)

    def _next_request_id(self) -> int:
        return namespaced_request_id(self.frontend_id, next(self._request_ids))

    def abort(self, request_id: int, seq_index: int | None = None) -> None:
        if not self.is_dead and not self._closed:
            self._send_abort(request_id, seq_index)

    # ---- sleep and wakeup --------------------------------------------------------------------

    def sleep(
        self, level: int = 1, mode: str = "drain", timeout: float = DEFAULT_DRAIN_TIMEOUT
    ) -> TransitionResult:
        """Puts the engine to sleep and returns once it is PARKED (see `Sleep`). Raises
        ValueError for a bad parameter, TransitionError("conflict") when the engine is not
        RUNNING, EngineDeadError if it dies on the way."""
        control = Sleep(level, mode, timeout, next(self._transition_ids))
        control.validate()
        return self._transition(control, timeout + self.config.transition_timeout)

    def wake_up(self, model: str | None = None) -> TransitionResult:
        """Wakes the engine (optionally with another revision of its model, see `Wakeup`) and
        returns once it is RUNNING. Raises TransitionError("conflict") when it is not PARKED,
        TransitionError("invalid_model") for a model it cannot serve (it stays PARKED)."""
        control = Wakeup(model, next(self._transition_ids))
        control.validate()
        return self._transition(control, self.config.transition_timeout)

    def _transition(self, control: Control, bound: float) -> TransitionResult:
        """Sends `control` and waits for its result. It must come within `bound` seconds: the
        stall watchdog holds the engine to that deadline (`overdue_transition`)."""
        self._raise_if_closed()
        pending = _PendingTransition(control.kind, bound)
        with self._results_lock:  # registered before it is sent, like a request's result
            self._transitions[control.transition_id] = pending
        try:
            self._raise_if_closed()
            self._send_control(control)
            result = pending.wait(bound + TRANSITION_GRACE)
        finally:
            with self._results_lock:
                self._transitions.pop(control.transition_id, None)
        if result is None:
            raise TimeoutError(f"the engine did not finish the {control.kind} within {bound:.0f} s")
        if result.error is not None:
            raise result.error
        return result

    def _finish_transition(self, result: TransitionResult) -> None:
        if result.stats is not None:
            self._take_stats(result.stats)
            if result.kind == "wakeup" and result.error is None:
                self._steps_at_start = result.stats.num_steps  # its first step may compile again
        with self._results_lock:
            pending = self._transitions.get(result.transition_id)
        if pending is not None:
            pending.finish(result)

    def overdue_transition(self) -> _PendingTransition | None:
        """A sleep or wakeup sent to the engine and not done by its deadline, if there is one."""
        now = time.monotonic()
        with self._results_lock:
            return next((t for t in self._transitions.values() if now > t.deadline), None)

    def check_health(self) -> bool:
        """True while the engine lives and is not shutting down. Never blocks and never starts a
        shutdown."""
        if self._closed or self.is_dead:
            return False
        self._check_workers()
        return not self.is_dead

    @property
    def num_pending(self) -> int:
        return len(self._results)

    def has_work(self) -> bool:
        """Requests of this process pending, or (the latest stats say) any in the engine."""
        stats = self._stats
        return bool(self._results) or (stats is not None and stats.num_running + stats.num_waiting > 0)

    @property
    def awaiting_first_step(self) -> bool:
        """No step done since the engine loaded or last woke up."""
        return self._stats is None or self._stats.num_steps <= self._steps_at_start

    def _raise_unless_admitting(self) -> None:
        if self._admission_stopped is not None:
            raise RequestError(
                f"engine is not admitting requests (admission state: shutdown): {self._admission_stopped}",
                "admission_closed",
            )

    def _raise_if_closed(self) -> None:
        if self._fatal_error is not None:
            raise EngineDeadError(f"the engine is dead: {self._fatal_error}") from self._fatal_error
        if self._closed:
            raise EngineDeadError("the executor has been shut down")

    # ---- the engine's side --------------------------------------------------------------------

    def _deliver(
        self, items: list[tuple[list[Response | SequenceUpdate], EngineStats] | TransitionResult]
    ) -> None:
        """The engine's output in the order it produced it: step batches (dispatched together)
        up to each transition result, then that result."""
        batches: list[tuple[list[Response | SequenceUpdate], EngineStats]] = []
        for item in items:
            if isinstance(item, TransitionResult):
                if batches:
                    self._dispatch(batches)
                    batches = []
                self._finish_transition(item)
            else:
                batches.append(item)
        if batches:
            self._dispatch(batches)

    def _dispatch(self, batches: list[tuple[list[Response | SequenceUpdate], EngineStats]]) -> None:
        """Routes responses (raw, or postprocessed by a postprocess worker) to their results, and
        other frontends' to `foreign_sink`; wakes each asyncio loop once for the whole lot."""
        to_wake: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = defaultdict(list)
        for responses, stats in batches:
            self._take_stats(stats)
            by_request: dict[int, list[Response | SequenceUpdate]] = defaultdict(list)
            foreign: dict[int, list[Response | SequenceUpdate]] = defaultdict(list)
            for response in responses:
                frontend = frontend_of(response.request_id)
                if frontend == self.frontend_id:
                    by_request[response.request_id].append(response)
                else:
                    foreign[frontend].append(response)
            if foreign and self.foreign_sink is not None:
                self.foreign_sink(foreign, stats)
            for request_id, mine in by_request.items():
                result = self._results.get(request_id)
                if result is None:
                    continue  # a late response for a finished or unknown request: nobody waits for it
                for seq_index in self._apply(result, mine, stats.timestamp):
                    self.abort(request_id, seq_index)  # ended on this side: a stop string, a failure
                if result.finished:
                    with self._results_lock:
                        self._results.pop(request_id, None)
                for loop, future in result._take_waiters():
                    to_wake[loop].append(future)
        _wake(to_wake)

    @staticmethod
    def _apply(
        result: GenerationResult, responses: list[Response | SequenceUpdate], step_time: float
    ) -> list[int | None]:
        """`result._handle`, within the request's own bounds: anything it raises fails that
        request alone (the others of the batch, and the engine, go on)."""
        try:
            return result._handle(responses, step_time)
        except Exception:
            logger.exception("request %d failed while its responses were applied", result.request_id)
            result._fail(internal_error("postprocess"))
            return [None]

    def _take_stats(self, stats: EngineStats) -> None:
        # Postprocess workers' lanes and heartbeats carry stats too, each in its own order: the
        # latest snapshot (by its sequence number, not the wall clock) wins, whichever way it came.
        latest = self._stats
        if latest is None or stats.seq >= latest.seq:
            self._stats = stats
            stepped = latest is None or stats.num_steps != latest.num_steps
            if stepped or stats.num_running + stats.num_waiting == 0:
                self.progress_at = time.monotonic()

    def _set_fatal(self, error: BaseException) -> None:
        """Records the first fatal error and fails everything pending with EngineDeadError."""
        with self._fatal_lock:
            if self._fatal_error is not None:
                return  # the first error wins: it is the root cause, later ones are echoes
            self._fatal_error = error
        logger.error("engine died: %s", error)
        self._fail_pending(EngineDeadError(f"the engine is dead: {error}"))

    def _fail_pending(self, error: BaseException) -> None:
        with self._results_lock:
            pending = list(self._results.values())
            self._results.clear()
            transitions = list(self._transitions.values())
        for transition in transitions:
            transition.fail(error)
        to_wake: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = defaultdict(list)
        for result in pending:
            result._fail(error)
            for loop, future in result._take_waiters():
                to_wake[loop].append(future)
        _wake(to_wake)


class _PendingTransition:
    """A sleep or wakeup sent to the engine and not answered yet, and when it must be done by."""

    def __init__(self, kind: str, bound: float) -> None:
        self.kind = kind
        self.bound = bound
        self.started = time.monotonic()
        self.deadline = self.started + bound
        self._done = threading.Event()
        self._result: TransitionResult | None = None
        self._error: BaseException | None = None

    def finish(self, result: TransitionResult) -> None:
        self._result = result
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: float) -> TransitionResult | None:
        """The result; None after `timeout`; raises the error that failed it."""
        if not self._done.wait(timeout):
            return None
        if self._error is not None:
            raise self._error
        return self._result


def _wake(to_wake: dict[asyncio.AbstractEventLoop, list[asyncio.Future]]) -> None:
    for loop, futures in to_wake.items():
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_release, futures)


def _release(futures: list[asyncio.Future]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)
