"""`GenerationExecutor`: the boundary between the LLM API and the engine.

It keeps the ledger of pending results, routes each step's responses to them from one
dispatch thread, and owns the failure semantics: a `RequestError` fails one request; a fatal
error is recorded once (the first wins), marks the engine dead, wakes every pending result
with `EngineDeadError` at once and refuses every later submit. Subclasses decide where the
engine runs (this process, or a worker process) and how messages get there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from abc import ABC, abstractmethod
from collections import defaultdict

from berth.engine.executor.errors import EngineDeadError
from berth.engine.executor.request import GenerationRequest
from berth.engine.executor.response import Response
from berth.engine.executor.result import GenerationResult

logger = logging.getLogger(__name__)


class GenerationExecutor(ABC):
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._results: dict[int, GenerationResult] = {}
        self._results_lock = threading.Lock()
        self._client_ids = itertools.count(1)
        self._fatal_lock = threading.Lock()
        self._fatal_error: BaseException | None = None
        self._closed = False
        self.stats = None  # the engine's latest EngineStats, updated with every step

    # ---- what subclasses provide --------------------------------------------------------------

    @abstractmethod
    def _send_request(self, request: GenerationRequest) -> None: ...

    @abstractmethod
    def _send_abort(self, client_id: int, seq_index: int | None) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abstractmethod
    def engine_pid(self) -> int:
        """The process id of the process that runs the engine (rank 0 of the world)."""

    @property
    @abstractmethod
    def admission_state(self) -> str:
        """The engine's admission state: "running", "parking", "parked", "waking" or "failed"."""

    def _check_workers(self) -> None:  # noqa: B027 (optional: only shapes with workers poll them)
        """Notices a dead worker without blocking (the polling backstop); may call `_set_fatal`."""

    # ---- the client's side --------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._fatal_error is not None

    @property
    def fatal_error(self) -> BaseException | None:
        return self._fatal_error

    def submit(self, request: GenerationRequest, *, prompt: str | None = None) -> GenerationResult:
        self._raise_if_dead()
        if self._closed:
            raise RuntimeError("the executor has been shut down")
        request.client_id = next(self._client_ids)
        result = GenerationResult(request, tokenizer=self.tokenizer, prompt=prompt, abort=self.abort)
        # Register before sending, so a response that comes back at once always has a home.
        with self._results_lock:
            self._results[request.client_id] = result
        try:
            # The engine may have died since the first check; the death sweep may have missed us.
            self._raise_if_dead()
            self._send_request(request)
        except BaseException:
            with self._results_lock:
                self._results.pop(request.client_id, None)
            raise
        return result

    def abort(self, client_id: int, seq_index: int | None = None) -> None:
        if not self.is_dead and not self._closed:
            self._send_abort(client_id, seq_index)

    def check_health(self) -> bool:
        """True while the engine lives. Never blocks and never starts a shutdown."""
        if not self.is_dead:
            self._check_workers()
        return not self.is_dead

    @property
    def num_pending(self) -> int:
        return len(self._results)

    def _raise_if_dead(self) -> None:
        if self._fatal_error is not None:
            raise EngineDeadError(f"the engine is dead: {self._fatal_error}") from self._fatal_error

    # ---- the engine's side --------------------------------------------------------------------

    def _dispatch(self, batches: list[tuple[list[Response], object]]) -> None:
        """Routes responses to their results; wakes each asyncio loop once for the whole lot."""
        to_wake: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = defaultdict(list)
        for responses, stats in batches:
            self.stats = stats
            by_client: dict[int, list[Response]] = defaultdict(list)
            for response in responses:
                by_client[response.client_id].append(response)
            for client_id, mine in by_client.items():
                result = self._results.get(client_id)
                if result is None:
                    continue  # a late response for a finished or unknown request: nobody waits for it
                for seq_index in result._handle(mine):
                    self.abort(client_id, seq_index)  # a stop string ended it client-side
                if result.finished:
                    with self._results_lock:
                        self._results.pop(client_id, None)
                waiter = result._take_waiter()
                if waiter is not None:
                    to_wake[waiter[0]].append(waiter[1])
        _wake(to_wake)

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
        to_wake: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = defaultdict(list)
        for result in pending:
            result._fail(error)
            waiter = result._take_waiter()
            if waiter is not None:
                to_wake[waiter[0]].append(waiter[1])
        _wake(to_wake)


def _wake(to_wake: dict[asyncio.AbstractEventLoop, list[asyncio.Future]]) -> None:
    for loop, futures in to_wake.items():
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_release, futures)


def _release(futures: list[asyncio.Future]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)
