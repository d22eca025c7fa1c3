"""Whether the worlds should sleep now: the manual switch and the cron schedules, one rule.

The rule (operator/README.md, "Sleep"):

- `spec.sleep.sleeping: true` wins while it is set: every world sleeps at `spec.sleep.level`,
  whatever the schedules say.
- Otherwise the worlds follow the latest schedule firing the operator has seen: a `Sleep`
  firing sleeps them at its level, a `Wake` firing wakes them. Schedules are edge-triggered: a
  schedule acts at its times from when the operator first evaluates it, never retroactively
  (adding "sleep at 22:00" at noon does not put the worlds to sleep at noon). Before any
  firing, or once the schedule that fired last is removed, the worlds are awake.
- Firings while the manual switch is set are still recorded, so clearing it hands the worlds
  to whatever the schedules said last.

Pure functions of the spec, the memory kept in `status.sleepSchedule` and the time, so a
restarted operator continues where it was, and catches up a firing it was down for.
"""

from __future__ import annotations

import datetime as dt
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from croniter import croniter

from berth.operator.crd_model import LLMDeploymentSpec, SleepSchedule
from berth.operator.restarts import format_time, parse_time

# croniter's get_prev is strict (a start exactly at a firing returns the one before it):
# look back from just after `now`, so a firing at `now` counts now.
_JUST_AFTER = dt.timedelta(microseconds=1)


@dataclass(frozen=True)
class SleepIntent:
    """What the worlds should be doing, and who says so."""

    asleep: bool
    level: int = 1
    # "spec.sleep", "schedule NAME", or "" (no one asks for sleep).
    source: str = ""


@dataclass(frozen=True)
class Evaluation:
    intent: SleepIntent
    memory: dict[str, Any]  # the new status.sleepSchedule
    next_transition: dict[str, Any] | None  # status.nextTransition


def _local(schedule: SleepSchedule, when: dt.datetime) -> dt.datetime:
    return when.astimezone(zoneinfo.ZoneInfo(schedule.timezone))


def previous_firing(schedule: SleepSchedule, now: dt.datetime) -> dt.datetime:
    """The latest firing at or before `now` (in UTC), read in the schedule's time zone."""
    start = _local(schedule, now + _JUST_AFTER)
    return croniter(schedule.cron, start).get_prev(dt.datetime).astimezone(dt.timezone.utc)


def next_firing(schedule: SleepSchedule, now: dt.datetime) -> dt.datetime:
    """The first firing after `now` (in UTC)."""
    return croniter(schedule.cron, _local(schedule, now)).get_next(dt.datetime).astimezone(dt.timezone.utc)


def _firing(schedule: SleepSchedule, when: dt.datetime) -> dict[str, Any]:
    return {
        "schedule": schedule.name,
        "action": schedule.action,
        "level": schedule.level,
        "time": format_time(when),
    }


def evaluate(spec: LLMDeploymentSpec, memory: Mapping[str, Any] | None, now: dt.datetime) -> Evaluation:
    """Apply the firings since the last one applied; say what the worlds should do and what is next.

    `memory` (status.sleepSchedule) holds, per schedule, since when the operator knows it
    (`seen`: a new or changed schedule acts only at its firings after that), and the latest
    firing applied (`lastFiring`). It changes only when a schedule fires or the schedules
    change, so a quiet deployment costs no status write per poll.
    """
    memory = dict(memory or {})
    schedules = {schedule.name: schedule for schedule in spec.sleep_schedules}
    seen_before = memory.get("seen") or {}
    seen: dict[str, dict[str, str]] = {}
    for schedule in schedules.values():
        known = seen_before.get(schedule.name) or {}
        same = known.get("cron") == schedule.cron and known.get("timezone") == schedule.timezone
        since = known["since"] if same and known.get("since") else format_time(now)
        seen[schedule.name] = {"cron": schedule.cron, "timezone": schedule.timezone, "since": since}

    last = memory.get("lastFiring")
    applied_until = parse_time(last["time"]) if last else None
    fired = []
    for index, schedule in enumerate(schedules.values()):
        when = previous_firing(schedule, now)
        floor = parse_time(seen[schedule.name]["since"])
        if applied_until is not None:
            floor = max(floor, applied_until)
        if floor < when <= now:
            fired.append((when, index, schedule))
    if fired:
        # Two schedules firing at once: the one listed later in the spec wins.
        when, _, schedule = max(fired, key=lambda item: (item[0], item[1]))
        # appliedAt: when the operator acted on it (at most one poll after `time`, usually at it).
        last = {**_firing(schedule, when), "appliedAt": format_time(now)}
    new_memory: dict[str, Any] = {"seen": seen} if seen else {}
    if last is not None:
        # Kept after its schedule is removed (as the mark of what was applied, so older firings
        # of the other schedules never count again), but it no longer holds the worlds.
        new_memory["lastFiring"] = last
    if last is not None and last.get("schedule") not in schedules:
        last = None

    if spec.sleep.sleeping:
        intent = SleepIntent(True, spec.sleep.level, "spec.sleep")
    elif last is not None and last["action"] == "Sleep":
        intent = SleepIntent(True, int(last["level"]), f"schedule {last['schedule']}")
    else:
        intent = SleepIntent(False)

    upcoming = sorted(
        ((next_firing(schedule, now), index, schedule) for index, schedule in enumerate(schedules.values())),
        key=lambda item: (item[0], item[1]),
    )
    next_transition = None
    if upcoming:
        when, _, schedule = upcoming[0]
        next_transition = _firing(schedule, when)
        if spec.sleep.sleeping:
            next_transition["heldBy"] = "spec.sleep"
            next_transition["message"] = (
                f"schedule {schedule.name} fires {schedule.action} at {next_transition['time']}, but "
                "spec.sleep.sleeping is set and wins: the worlds sleep until it is cleared"
            )
        else:
            level = f" at level {schedule.level}" if schedule.action == "Sleep" else ""
            next_transition["message"] = (
                f"{schedule.action}{level} at {next_transition['time']} (schedule {schedule.name})"
            )
    return Evaluation(intent=intent, memory=new_memory, next_transition=next_transition)


def seconds_until(next_transition: Mapping[str, Any] | None, now: dt.datetime) -> float | None:
    """How long until the next firing (the health loop wakes up for it)."""
    if not next_transition:
        return None
    return max((parse_time(next_transition["time"]) - now).total_seconds(), 0.0)
