"""The engine's inbox, and the admission state machine that decides what it accepts.

Requests, aborts and control messages ride one ordered queue, so an abort can never
overtake the request it cancels. Admission is checked and the item enqueued under one lock:
a request can never slip in between a check that saw RUNNING and a transition to PARKING.
"""

from __future__ import annotations

import enum
import queue
import threading
from dataclasses import dataclass

from berth.engine.executor.errors import RequestError
from berth.engine.executor.request import GenerationRequest


class AdmissionState(enum.Enum):
    RUNNING = "running"  # admitting requests
    PARKING = "parking"  # admission stopped; in-flight requests drain
    PARKED = "parked"  # drained; device memory released
    WAKING = "waking"  # restoring device memory
    FAILED = "failed"  # a transition failed; the engine cannot admit again


@dataclass(slots=True)
class Abort:
    client_id: int
    seq_index: int | None = None  # None: every sequence of the request


class Shutdown:
    """Sentinel: the loop finishes what it must and exits."""


QueueItem = GenerationRequest | Abort | Shutdown


class RequestQueue:
    def __init__(self) -> None:
        self._items: queue.SimpleQueue[QueueItem] = queue.SimpleQueue()
        self._enqueue_lock = threading.Lock()
        self._admission = AdmissionState.RUNNING

    @property
    def admission_state(self) -> AdmissionState:
        return self._admission

    def enqueue_request(self, request: GenerationRequest) -> None:
        with self._enqueue_lock:
            if self._admission is not AdmissionState.RUNNING:
                raise RequestError(
                    f"engine is not admitting requests (admission state: {self._admission.value})",
                    code="admission_closed",
                )
            self._items.put(request)

    def enqueue_abort(self, client_id: int, seq_index: int | None = None) -> None:
        self._items.put(Abort(client_id, seq_index))

    def enqueue_shutdown(self) -> None:
        self._items.put(Shutdown())

    def transition(self, expected: AdmissionState, target: AdmissionState) -> None:
        """Compare-and-set: moves to `target` only from `expected`."""
        with self._enqueue_lock:
            if self._admission is not expected:
                raise RuntimeError(
                    f"invalid admission transition to {target.value}: state is {self._admission.value}, "
                    f"expected {expected.value}"
                )
            self._admission = target

    def get(self, timeout: float | None) -> QueueItem | None:
        """The next item; blocks up to `timeout` seconds (None: forever, 0: not at all)."""
        try:
            return self._items.get(block=timeout != 0, timeout=timeout or None)
        except queue.Empty:
            return None

    def empty(self) -> bool:
        return self._items.empty()

    def get_nowait_all(self) -> list[QueueItem]:
        items = []
        while True:
            try:
                items.append(self._items.get_nowait())
            except queue.Empty:
                return items
