"""When may a dead world be restarted: exponential backoff inside a restart budget.

Pure functions of the restart history kept in the world's status (so a restarted operator
continues the same budget and backoff instead of starting over) and of the current time.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from berth.operator.crd_model import HealthSpec


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int
    window_seconds: float
    backoff_seconds: float
    max_backoff_seconds: float

    @classmethod
    def from_spec(cls, health: HealthSpec) -> RestartPolicy:
        return cls(
            max_restarts=health.max_restarts,
            window_seconds=health.restart_window_seconds,
            backoff_seconds=health.backoff_seconds,
            max_backoff_seconds=health.max_backoff_seconds,
        )


@dataclass(frozen=True)
class RestartDecision:
    action: Literal["restart", "wait", "exhausted"]
    # restart: restarts inside the window before this one. wait: seconds still to wait.
    # exhausted: seconds until the oldest restart leaves the window (then the budget refills).
    seconds: float = 0.0
    restarts_in_window: int = 0


def parse_time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_time(value: dt.datetime) -> str:
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def recent_restarts(times: Iterable[str], now: dt.datetime, window_seconds: float) -> list[dt.datetime]:
    """Restart times inside the sliding window, oldest first."""
    horizon = now - dt.timedelta(seconds=window_seconds)
    return sorted(t for t in (parse_time(value) for value in times) if t > horizon)


def backoff_delay(restarts_in_window: int, policy: RestartPolicy) -> float:
    """The first restart in a window is immediate; then base, 2*base, 4*base ... up to the cap."""
    if restarts_in_window <= 0:
        return 0.0
    return min(policy.backoff_seconds * 2 ** (restarts_in_window - 1), policy.max_backoff_seconds)


def decide(times: Iterable[str], now: dt.datetime, policy: RestartPolicy) -> RestartDecision:
    recent = recent_restarts(times, now, policy.window_seconds)
    if len(recent) >= policy.max_restarts:
        refill = (
            (recent[0] + dt.timedelta(seconds=policy.window_seconds) - now).total_seconds() if recent else 0.0
        )
        return RestartDecision("exhausted", max(refill, 0.0), len(recent))
    if recent:
        due = recent[-1] + dt.timedelta(seconds=backoff_delay(len(recent), policy))
        if now < due:
            return RestartDecision("wait", (due - now).total_seconds(), len(recent))
    return RestartDecision("restart", 0.0, len(recent))


def world_restart_budget_exhausted(times: Iterable[str], now: dt.datetime, policy: RestartPolicy) -> bool:
    return decide(times, now, policy).action == "exhausted"
