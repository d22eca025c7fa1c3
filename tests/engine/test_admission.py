"""The request queue's admission state machine (seed 001): compare-and-set under the enqueue
lock, refusals that name the state, and the queue order that makes a sleep drain exactly what
was admitted before it."""

from __future__ import annotations

import threading
import time

import pytest

from berth.engine.engine_io import (
    AbortRequest,
    GenerationRequest,
    RequestError,
    Shutdown,
    Sleep,
    TransitionError,
    Wakeup,
)
from berth.engine.pyexecutor.request_queue import AdmissionState, RequestQueue
from berth.engine.sampling_params import SamplingParams


def request(request_id: int) -> GenerationRequest:
    return GenerationRequest([1, 2, 3], SamplingParams(max_tokens=1), request_id=request_id)


def test_a_sleep_is_queued_behind_what_was_admitted_and_closes_admission_at_once():
    queue = RequestQueue()
    queue.enqueue_request(request(1))
    queue.enqueue_control(Sleep(level=1, transition_id=7))
    assert queue.admission_state is AdmissionState.PARKING
    with pytest.raises(RequestError, match=r"admission state: parking") as refused:
        queue.enqueue_request(request(2))
    assert refused.value.code == "admission_closed"
    queue.enqueue_abort(AbortRequest(1))  # aborts still get through: they end what was admitted
    items = queue.get_nowait_all()
    assert [type(item) for item in items] == [GenerationRequest, Sleep, AbortRequest]
    assert items[0].request_id == 1


@pytest.mark.parametrize("state", [AdmissionState.PARKED, AdmissionState.WAKING])
def test_requests_are_refused_while_asleep_and_while_waking(state):
    queue = queue_in(state.value)
    assert queue.admission_state is state
    with pytest.raises(RequestError, match=f"admission state: {state.value}"):
        queue.enqueue_request(request(1))


@pytest.mark.parametrize(
    ("state", "control", "message"),
    [
        ("running", Wakeup(), "cannot wake up: the engine is awake"),
        ("parking", Sleep(), "cannot sleep: another transition is running"),
        ("parking", Wakeup(), "cannot wake up: another transition is running"),
        ("parked", Sleep(), "cannot sleep: the engine is already asleep"),
        ("waking", Sleep(), "cannot sleep: another transition is running"),
        ("waking", Wakeup(), "cannot wake up: another transition is running"),
        ("shutdown", Sleep(), "the engine is shutdown"),
    ],
)
def test_a_transition_from_the_wrong_state_is_a_conflict_that_changes_nothing(state, control, message):
    queue = queue_in(state)
    with pytest.raises(TransitionError, match=message) as refused:
        queue.enqueue_control(control)
    assert refused.value.code == "conflict" and refused.value.admission == state
    assert queue.admission_state.value == state
    assert queue.get_nowait_all() == []  # nothing was queued by the refusal


def queue_in(state: str) -> RequestQueue:
    """A queue taken to `state` the way the engine takes it there, emptied."""
    queue = RequestQueue()
    if state == "shutdown":
        queue.enqueue_shutdown()
    if state in ("parking", "parked", "waking"):
        queue.enqueue_control(Sleep())
    if state in ("parked", "waking"):
        queue.transition(AdmissionState.PARKING, AdmissionState.PARKED)
    if state == "waking":
        queue.enqueue_control(Wakeup())
    queue.get_nowait_all()
    return queue


def test_of_many_transitions_asked_for_at_once_exactly_one_starts():
    """The interleaving a lost compare-and-set needs is forced: the first transition to get past
    the check is held there (checked, state not moved yet) until every other thread has asked
    and had time to get past the check too. Only the lock keeps them out."""
    queue = RequestQueue()
    start = threading.Barrier(16)
    outcomes: list[str] = []
    asked = threading.Semaphore(0)
    enqueue_control, move = queue.enqueue_control, queue._set
    held = threading.Event()

    def asking(control) -> None:
        asked.release()
        enqueue_control(control)

    def held_inside(state) -> None:  # the critical section, between the check and the move
        if not held.is_set():
            held.set()
            for _ in range(15):  # every other thread has asked ...
                assert asked.acquire(timeout=10)
            time.sleep(0.2)  # ... and, without the lock, got past the check meanwhile
        move(state)

    queue.enqueue_control, queue._set = asking, held_inside

    def ask(index: int) -> None:
        control = Sleep(transition_id=index) if index % 2 else Wakeup(transition_id=index)
        start.wait()
        try:
            queue.enqueue_control(control)
            outcomes.append("started")
        except TransitionError:
            outcomes.append("conflict")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(outcomes) == ["conflict"] * 15 + ["started"]
    assert queue.admission_state is AdmissionState.PARKING
    assert [type(item) for item in queue.get_nowait_all()] == [Sleep]


def test_shutdown_wins_from_every_state_and_counts_transitions():
    queue = RequestQueue()
    queue.enqueue_control(Sleep())
    queue.transition(AdmissionState.PARKING, AdmissionState.PARKED)
    queue.enqueue_shutdown()
    assert queue.admission_state is AdmissionState.SHUTDOWN
    queue.fail()  # a transition failing during a shutdown leaves it a shutdown
    assert queue.admission_state is AdmissionState.SHUTDOWN
    assert isinstance(queue.get_nowait_all()[-1], Shutdown)
    assert queue.transitions == {"parking": 1, "parked": 1, "shutdown": 1}


@pytest.mark.parametrize(
    ("control", "message"),
    [
        (Sleep(level=3), "level must be 1 or 2"),
        (Sleep(level=True), "level must be 1 or 2"),
        (Sleep(level=1.0), "level must be 1 or 2"),
        (Sleep(mode="later"), "mode must be one of"),
        (Sleep(drain_timeout=-1), "timeout must be"),
        (Sleep(drain_timeout=float("nan")), "timeout must be"),
        (Wakeup(model=""), "model must be a non-empty path"),
        (Wakeup(model=3), "model must be a non-empty path"),
    ],
)
def test_controls_validate_their_parameters(control, message):
    with pytest.raises(ValueError, match=message):
        control.validate()
