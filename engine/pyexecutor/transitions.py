"""Sleep and wakeup inside the engine loop: the state machine that moves admission on, between steps.

    sleep    queued: PARKING (admission closed at once, by the request queue)
             the turn that takes it up: the batch drains (or, in abort mode, is aborted)
             the turn whose step ends the drain (or whose drain timeout passes, aborting the
             rest): only its responses go out, the drain's last tokens among them
             the next turn, a turn of its own: memory released on every rank, PARKED
    wakeup   queued: WAKING
             the turn that takes it up only says so (WAKING goes out with its stats)
             the next turn, a turn of its own: weights staged on every rank (a revision that
             does not fit is refused: PARKED again, with the weights it had), committed, one
             token through the model, RUNNING

Memory work never shares a turn with responses: it may take seconds (a weight offload, a reload
from disk), which no client waits for. Each transition ends with a `TransitionResult` in
`finished`, sent by the loop after that turn's responses. One that fails half-way leaves the
engine FAILED, and the error ends the loop: fatal. A shutdown that comes first wins.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from berth.engine.engine_io import (
    EngineMemory,
    Response,
    Sleep,
    TransitionError,
    TransitionResult,
    Wakeup,
)
from berth.engine.pyexecutor.request_queue import AdmissionState
from berth.engine.pyexecutor.sleep import (
    CommitWakeup,
    DiscardStagedWeights,
    MemoryAction,
    RankOutcome,
    ReleaseMemory,
    StageWeights,
)

if TYPE_CHECKING:
    from berth.engine.pyexecutor.py_executor import PyExecutor


@dataclass
class _Parking:
    """A sleep under way: admission is closed and the batch drains until `deadline`."""

    control: Sleep
    started: float  # time.monotonic()
    deadline: float
    memory_before: EngineMemory
    num_aborted: int = 0
    drain_seconds: float = 0.0  # set once the drain is over


class Transitions:
    """The sleeps and wakeups of one engine (`PyExecutor`), which calls in at every turn."""

    def __init__(self, engine: PyExecutor) -> None:
        self._engine = engine
        self.parking: _Parking | None = None  # a sleep whose batch drains
        self._releasing: _Parking | None = None  # drained: memory is released in the next turn
        self._waking: Wakeup | None = None  # taken up, carried out in the next turn
        self.sleep_level = 0  # of the sleep under way or done; 0 while running
        self.finished: list[TransitionResult] = []  # sent by the loop after each turn
        self.state_changed = False  # stats go out after this turn even if it answered nobody

    # ---- what the loop asks at every turn --------------------------------------------------------

    @property
    def has_a_turn_of_its_own(self) -> bool:
        """Memory work is due: a wakeup taken up, or a sleep whose drain is over."""
        return self._waking is not None or self._releasing is not None

    def take_its_turn(self) -> None:
        if self._waking is not None:
            wakeup, self._waking = self._waking, None
            self._wake_up(wakeup)
        elif self._releasing is not None:
            drained, self._releasing = self._releasing, None
            self._release(drained)

    def begin_sleep(self, control: Sleep) -> list[Response]:
        """Admission closed when the sleep was queued (PARKING); the batch drains from here."""
        now = time.monotonic()
        self.parking = _Parking(control, now, now + control.drain_timeout, self._engine.memory.memory())
        self.sleep_level = control.level
        self.state_changed = True  # PARKING reaches the stats now, even if no step answers anyone
        if control.mode != "abort":
            return []
        return self._abort_for_sleep(
            f"aborted: the engine is going to sleep (level {control.level}, mode abort)"
        )

    def begin_wakeup(self, control: Wakeup) -> None:
        self._waking = control
        self.state_changed = True

    def continue_sleep(self) -> list[Response]:
        """After a turn's step: the drain is over once nothing runs, or its timeout has passed
        (what runs is aborted, saying why); memory is released in the next turn."""
        parking, engine = self.parking, self._engine
        if engine.shutting_down:  # a shutdown came first: there is nothing to sleep for
            self.parking = None
            self._refuse(parking.control, "the engine is shutting down", AdmissionState.SHUTDOWN)
            return []
        responses: list[Response] = []
        if engine.scheduler.has_work():
            if time.monotonic() < parking.deadline:
                return []
            responses = self._abort_for_sleep(
                f"aborted: the engine went to sleep and its drain timeout "
                f"({parking.control.drain_timeout:g} s) passed before this request finished"
            )
        self.parking = None
        parking.drain_seconds = time.monotonic() - parking.started
        self._releasing = parking
        return responses

    # ---- the memory work, each in a turn of its own ------------------------------------------------

    def _release(self, parking: _Parking) -> None:
        """The drain is over and its responses are out: memory goes, and the engine is PARKED."""
        self._on_every_rank(ReleaseMemory(parking.control.level), "release memory for a sleep")
        if self._move(AdmissionState.PARKING, AdmissionState.PARKED):
            self._report(
                parking.control,
                parking.started,
                parking.memory_before,
                parking.drain_seconds,
                parking.num_aborted,
            )

    def _abort_for_sleep(self, reason: str) -> list[Response]:
        self.parking.num_aborted += self._engine.num_active
        return self._engine.abort_all(reason)

    def _wake_up(self, control: Wakeup) -> None:
        """WAKING since it was queued; the engine is idle (nothing is admitted while asleep)."""
        engine = self._engine
        if engine.shutting_down:
            self._refuse(control, "the engine is shutting down", AdmissionState.SHUTDOWN)
            return
        started, before = time.monotonic(), engine.memory.memory()
        staged = engine.memory_actions(StageWeights(control.model))
        failed = [outcome for outcome in staged if outcome.error is not None]
        if failed:
            self._on_every_rank(DiscardStagedWeights(), "drop the weights staged for a wakeup")
            errors = rank_errors(failed)
            if control.model is None:  # the engine's own weights could not be restored
                self._fail(f"wakeup failed: {errors}")
            if self._move(AdmissionState.WAKING, AdmissionState.PARKED):
                message = (
                    f"cannot wake up with {control.model}: {errors}. The engine is still parked and "
                    "can wake up with the weights it had"
                )
                self._refuse(control, message, AdmissionState.PARKED, code="invalid_model")
            return
        self._on_every_rank(CommitWakeup(), "restore memory for a wakeup")
        problem = engine.verify_forward()
        if problem is not None:
            self._fail(f"wakeup failed its check: {problem} ({engine.memory.revision.path})")
        engine.serve_model_config(engine.memory.model_config)  # a new revision may stop on other tokens
        self.sleep_level = 0
        if self._move(AdmissionState.WAKING, AdmissionState.RUNNING):
            self._report(control, started, before)

    def _on_every_rank(self, action: MemoryAction, doing: str) -> None:
        """`action` everywhere; one rank's failure fails the world (FAILED, then fatal)."""
        failed = [outcome for outcome in self._engine.memory_actions(action) if outcome.error is not None]
        if failed:
            self._fail(f"could not {doing}: {rank_errors(failed)}")

    def _fail(self, message: str) -> None:
        self._engine.request_queue.fail()
        raise RuntimeError(message)

    # ---- the state, and what is said about it ------------------------------------------------------

    def _move(self, expected: AdmissionState, target: AdmissionState) -> bool:
        """The loop's own compare-and-set; False when a shutdown came in between (it wins).
        Every change of state goes out in the stats (attach frontends follow admission there)."""
        queue = self._engine.request_queue
        try:
            queue.transition(expected, target)
        except RuntimeError:
            if queue.admission_state is AdmissionState.SHUTDOWN:
                return False
            raise
        self.state_changed = True
        return True

    def _report(
        self,
        control: Sleep | Wakeup,
        started: float,
        before: EngineMemory,
        drain_seconds: float = 0.0,
        num_aborted: int = 0,
    ) -> None:
        engine = self._engine
        self.finished.append(
            TransitionResult(
                transition_id=control.transition_id,
                kind=control.kind,
                admission=engine.request_queue.admission_state.value,
                seconds=time.monotonic() - started,
                drain_seconds=drain_seconds,
                num_aborted=num_aborted,
                memory_before=before,
                memory_after=engine.memory.memory(),
                model_revision=engine.memory.revision,
                stats=engine.stats(),
            )
        )

    def _refuse(
        self, control: Sleep | Wakeup, message: str, state: AdmissionState, code: str = "conflict"
    ) -> None:
        self.finished.append(
            TransitionResult(
                transition_id=control.transition_id,
                kind=control.kind,
                admission=state.value,
                error=TransitionError(message, code, state.value),
                model_revision=self._engine.memory.revision,
                stats=self._engine.stats(),
            )
        )


def rank_errors(failed: list[RankOutcome]) -> str:
    return "; ".join(f"rank {outcome.rank}: {outcome.error}" for outcome in failed)
