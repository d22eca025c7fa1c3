"""The engine's inbox, and the admission state machine that decides what it accepts.

Requests, aborts and control messages ride one ordered queue, so an abort can never
overtake the request it cancels. Admission is checked and the item enqueued under one lock:
a request can never slip in between a check that saw RUNNING and a transition away from it
(to PARKING, or to SHUTDOWN: a request either is queued ahead of the Shutdown sentinel, and is
answered, or is refused).

Sleep and wakeup start the same way (seed 001): the state's compare-and-set and the control
message's place in the queue are one step under that lock, so a request admitted before a
sleep is ahead of it in the queue (and drains), one offered after it is refused; and of two
transitions asked for at once, exactly one finds the state it starts from, the other gets a
conflict. The engine loop moves the state on from there (PARKING -> PARKED, WAKING -> RUNNING
or back to PARKED) between steps.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections import Counter

from berth.engine.engine_io import (
    AbortRequest,
    Control,
    GenerationRequest,
    RequestError,
    Shutdown,
    Sleep,
    TransitionError,
    Wakeup,
)


class AdmissionState(enum.Enum):
    RUNNING = "running"  # admitting requests
    PARKING = "parking"  # admission stopped; in-flight requests drain
    PARKED = "parked"  # drained; device memory released
    WAKING = "waking"  # restoring device memory
    FAILED = "failed"  # a transition failed; the engine cannot admit again
    SHUTDOWN = "shutdown"  # stopping for good: the last state, from any other


QueueItem = GenerationRequest | AbortRequest | Shutdown | Sleep | Wakeup

# A control's (state it starts from, state admission moves to when it is queued).
STARTS = {
    Sleep: (AdmissionState.RUNNING, AdmissionState.PARKING),
    Wakeup: (AdmissionState.PARKED, AdmissionState.WAKING),
}


class RequestQueue:
    def __init__(self) -> None:
        self._items: queue.SimpleQueue[QueueItem] = queue.SimpleQueue()
        self._enqueue_lock = threading.Lock()
        self._admission = AdmissionState.RUNNING
        self._since = time.time()
        self.transitions: Counter[str] = Counter()  # since start, by the state reached

    @property
    def admission_state(self) -> AdmissionState:
        return self._admission

    @property
    def admission_since(self) -> float:
        """When the current state was entered (wall clock)."""
        return self._since

    def enqueue_request(self, request: GenerationRequest) -> None:
        with self._enqueue_lock:
            if self._admission is not AdmissionState.RUNNING:
                raise RequestError(
                    f"engine is not admitting requests (admission state: {self._admission.value})",
                    code="admission_closed",
                )
            self._items.put(request)

    def enqueue_abort(self, abort: AbortRequest) -> None:
        self._items.put(abort)

    def enqueue_news(self, item: object) -> None:
        """News from the engine's own threads (a KV transfer asked for or done): never refused,
        and it wakes an idle loop."""
        self._items.put(item)

    def enqueue_shutdown(self) -> None:
        """Closes admission for good and queues the sentinel behind everything admitted."""
        with self._enqueue_lock:
            if self._admission is AdmissionState.SHUTDOWN:
                return
            self._set(AdmissionState.SHUTDOWN)
            self._items.put(Shutdown())

    def enqueue_control(self, control: Control) -> None:
        """Starts a sleep (RUNNING -> PARKING) or a wakeup (PARKED -> WAKING): the state moves and
        the control is queued behind everything admitted, or TransitionError("conflict")."""
        expected, target = STARTS[type(control)]
        with self._enqueue_lock:
            if self._admission is not expected:
                raise TransitionError(_conflict(control, self._admission), "conflict", self._admission.value)
            self._set(target)
            self._items.put(control)

    def transition(self, expected: AdmissionState, target: AdmissionState) -> None:
        """Compare-and-set: moves to `target` only from `expected`."""
        with self._enqueue_lock:
            if self._admission is not expected:
                raise RuntimeError(
                    f"invalid admission transition to {target.value}: state is {self._admission.value}, "
                    f"expected {expected.value}"
                )
            self._set(target)

    def fail(self) -> None:
        """A transition failed half-way: the engine admits nothing again (a shutdown under way
        stays what it is)."""
        with self._enqueue_lock:
            if self._admission is not AdmissionState.SHUTDOWN:
                self._set(AdmissionState.FAILED)

    def _set(self, state: AdmissionState) -> None:  # the caller holds the lock
        self._admission = state
        self._since = time.time()
        self.transitions[state.value] += 1

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


def _conflict(control: Control, state: AdmissionState) -> str:
    what = "sleep" if isinstance(control, Sleep) else "wake up"
    if state in (AdmissionState.PARKING, AdmissionState.WAKING):
        return f"cannot {what}: another transition is running (admission: {state.value})"
    if state is AdmissionState.PARKED:
        return "cannot sleep: the engine is already asleep (admission: parked)"
    if state is AdmissionState.RUNNING:
        return "cannot wake up: the engine is awake (admission: running)"
    return f"cannot {what}: the engine is {state.value}"
