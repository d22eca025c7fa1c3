"""The stall watchdog: an engine that has work and makes no progress is dead.

A dead engine is noticed by its process's exit; a stuck one (a stopped or wedged rank, a
collective that never completes, a hung device) is alive and silent, and would pass every
probe. The engine loop reports its stats after every step that answered someone and, while it
has work, at least every `py_executor.HEARTBEAT_SECONDS` (and four times a stall timeout;
`PyExecutor.run`). This thread, outside the engine's (it must run when the step is blocked,
and when the engine's whole process is stopped), declares the engine dead once it has had
work and no report of a step for the stall timeout: the first step after load or wakeup gets
the longer `first_step_timeout`. Sticky: an engine that resumes later stays dead (its results
were failed; its world is abandoned).

A sleep or wakeup has no requests to make progress on: it is held to its own deadline instead
(`EngineConfig.transition_timeout`, after a sleep's drain). One that is not done by then (a
weight reload from a hung file system, a rank stuck in a collective) kills the engine the same
way, with the transition named in the error.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

from berth.engine.engine_io import EngineStalledError


class StallWatchdog:
    """Watches `executor` (a `GenerationExecutor`) from a thread of its own.

    `detail()` adds what the executor can tell about the world when the stall is declared
    (which rank is stopped); `on_stall()` runs after the engine is marked dead."""

    def __init__(
        self,
        executor,
        stall_timeout: float,
        first_step_timeout: float,
        detail: Callable[[], str] = lambda: "",
        on_stall: Callable[[], None] = lambda: None,
    ) -> None:
        self._executor = executor
        self.stall_timeout = stall_timeout
        self.first_step_timeout = first_step_timeout
        self._detail = detail
        self._on_stall = on_stall
        self._interval = min(0.5, stall_timeout / 10)
        self._thread = threading.Thread(target=self._watch, name="berth-stall-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        """Until the engine is dead or shut down (then there is nothing left to watch)."""
        busy_since: float | None = None
        while True:
            time.sleep(self._interval)
            executor = self._executor
            if executor.is_dead or executor.is_closed:
                return
            overdue = executor.overdue_transition()
            if overdue is not None:
                executor._set_fatal(EngineStalledError(self._transition_message(overdue)))
                self._on_stall()
                return
            stats = executor._stats
            if not executor.has_work():
                busy_since = None
                continue
            now = time.monotonic()
            if busy_since is None:
                busy_since = now
            silent = now - max(busy_since, executor.progress_at)
            first_step = executor.awaiting_first_step
            bound = self.first_step_timeout if first_step else self.stall_timeout
            if silent <= bound:
                continue
            executor._set_fatal(EngineStalledError(self._message(bound, first_step, stats)))
            self._on_stall()
            return

    def _transition_message(self, transition) -> str:
        parts = [
            f"stalled: the {transition.kind} did not complete in {transition.bound:g} s "
            f"(--transition-timeout{', after the drain' if transition.kind == 'sleep' else ''})"
        ]
        detail = self._detail()
        if detail:
            parts.append(detail)
        else:  # nothing on this machine looks stuck from outside: say where it was running
            ranks = ", ".join(
                f"rank {rank} (pid {pid} on {host})" for rank, pid, host in self._executor.ranks
            )
            parts.append(f"it was running on {ranks}")
        return "; ".join(parts)

    def _message(self, bound: float, first_step: bool, stats) -> str:
        if first_step:
            parts = [f"stalled: the first step after load or wakeup did not complete in {bound:g} s"]
        else:
            parts = [f"stalled: no step completed in {bound:g} s"]
        if stats is not None:
            parts[0] += f" with {stats.num_running} requests running and {stats.num_waiting} waiting"
            if stats.num_steps:
                at = datetime.datetime.fromtimestamp(stats.timestamp).isoformat(timespec="seconds")
                parts.append(f"the last step ended at {at} (step {stats.num_steps})")
        else:
            parts[0] += f" with {self._executor.num_pending} requests pending"
        detail = self._detail()
        if detail:
            parts.append(detail)
        return "; ".join(parts)
