"""The sleep rule (manual switch and cron schedules, schedule.py) on a fake clock, and the
conditions it leads to."""

from __future__ import annotations

import datetime as dt
from typing import Any

from berth.operator import conditions, schedule
from berth.operator.crd_model import parse_spec

UTC = dt.timezone.utc
NOON = dt.datetime(2026, 3, 27, 12, 0, tzinfo=UTC)  # a Friday; Berlin is UTC+1 until Sunday
NIGHT = {"name": "night", "cron": "0 22 * * *", "timezone": "Europe/Berlin", "action": "Sleep", "level": 2}
MORNING = {"name": "morning", "cron": "0 6 * * *", "timezone": "Europe/Berlin", "action": "Wake"}


def spec(*schedules: dict[str, Any], sleeping: bool = False, level: int = 1) -> Any:
    return parse_spec(
        {
            "model": {"path": "/m"},
            "image": "berth:1",
            "sleep": {"sleeping": sleeping, "level": level},
            "sleepSchedules": list(schedules),
        }
    )


def run(the_spec: Any, times: list[dt.datetime], memory: dict | None = None) -> list[schedule.Evaluation]:
    """Evaluate at each time in turn, carrying the memory as status does."""
    results = []
    for now in times:
        result = schedule.evaluate(the_spec, memory, now)
        memory = result.memory
        results.append(result)
    return results


def at(hours: float, base: dt.datetime = NOON) -> dt.datetime:
    return base + dt.timedelta(hours=hours)


def test_a_schedule_acts_at_its_times_in_its_time_zone() -> None:
    both = spec(NIGHT, MORNING)
    first, before, after, morning = run(both, [NOON, at(8.99), at(9.0), at(18.5)])
    # Seen at noon: yesterday's 22:00 does not count (never retroactive).
    assert first.intent == schedule.SleepIntent(False)
    assert first.next_transition == {
        "schedule": "night",
        "action": "Sleep",
        "level": 2,
        "time": "2026-03-27T21:00:00.000000Z",  # 22:00 in Berlin (CET)
        "message": "Sleep at level 2 at 2026-03-27T21:00:00.000000Z (schedule night)",
    }
    assert before.intent.asleep is False
    assert after.intent == schedule.SleepIntent(True, 2, "schedule night")
    assert after.memory["lastFiring"]["time"] == "2026-03-27T21:00:00.000000Z"
    assert after.memory["lastFiring"]["appliedAt"] == "2026-03-27T21:00:00.000000Z"
    # Sunday's switch to summer time: 06:00 CEST is 04:00 UTC.
    assert after.next_transition["time"] == "2026-03-28T05:00:00.000000Z"
    assert morning.intent == schedule.SleepIntent(False)
    assert morning.memory["lastFiring"]["schedule"] == "morning"
    sunday = run(both, [at(24 + 9.5)], morning.memory)[0]
    assert sunday.intent.asleep and sunday.next_transition["time"] == "2026-03-29T04:00:00.000000Z"


def test_quiet_evaluations_leave_the_memory_alone() -> None:
    # No status write per poll: the memory changes only when a schedule fires or changes.
    results = run(spec(NIGHT, MORNING), [NOON, at(1), at(2), at(3)])
    assert all(result.memory == results[0].memory for result in results)


def test_a_firing_missed_while_the_operator_was_down_is_caught_up() -> None:
    seen = run(spec(NIGHT), [NOON])[0]
    # Next evaluation two days later: the latest firing decides, once.
    later = run(spec(NIGHT), [at(50)], seen.memory)[0]
    assert later.intent.asleep and later.memory["lastFiring"]["time"] == "2026-03-28T21:00:00.000000Z"


def test_the_manual_switch_wins_while_set_and_firings_still_count() -> None:
    held = spec(NIGHT, MORNING, sleeping=True, level=1)
    noon, night = run(held, [NOON, at(9.5)])
    assert noon.intent == schedule.SleepIntent(True, 1, "spec.sleep")
    assert night.intent == schedule.SleepIntent(True, 1, "spec.sleep")
    assert noon.next_transition["heldBy"] == "spec.sleep"
    assert "spec.sleep.sleeping is set and wins" in noon.next_transition["message"]
    # Cleared at 23:00: the schedules said Sleep (level 2) at 22:00, so the worlds stay asleep.
    cleared = run(spec(NIGHT, MORNING), [at(11)], night.memory)[0]
    assert cleared.intent == schedule.SleepIntent(True, 2, "schedule night")


def test_removing_the_schedule_that_fired_last_wakes_and_nothing_older_counts_again() -> None:
    # Sleep fired at 22:00; a Wake schedule fired before it, at 21:00.
    evening = {**MORNING, "name": "evening", "cron": "0 21 * * *"}
    _, night = run(spec(evening, NIGHT), [NOON, at(9.5)])
    assert night.intent.asleep
    removed = run(spec(evening), [at(10)], night.memory)[0]
    assert removed.intent == schedule.SleepIntent(False)
    # Likewise a removed Wake schedule does not bring back an older Sleep firing.
    _, morning = run(spec(NIGHT, MORNING), [NOON, at(18.5)])
    assert run(spec(NIGHT), [at(19)], morning.memory)[0].intent.asleep is False


def test_a_changed_cron_starts_over_and_ties_go_to_the_later_schedule() -> None:
    first = run(spec(NIGHT), [NOON])[0]
    changed = run(spec({**NIGHT, "cron": "0 12 * * *"}), [at(0.5)], first.memory)[0]
    assert changed.intent.asleep is False  # its 12:00 (Berlin) firing predates the change
    assert changed.memory["seen"]["night"]["since"] == "2026-03-27T12:30:00.000000Z"
    wake_too = {**MORNING, "cron": "0 22 * * *"}
    tie = run(spec(NIGHT, wake_too), [NOON, at(9.5)])[1]
    assert tie.intent.asleep is False and tie.memory["lastFiring"]["schedule"] == "morning"
    assert run(spec(wake_too, NIGHT), [NOON, at(9.5)])[1].intent.asleep


def test_no_schedules_no_next_transition() -> None:
    result = schedule.evaluate(spec(), None, NOON)
    assert result.intent == schedule.SleepIntent(False) and result.next_transition is None
    assert result.memory == {}
    assert schedule.seconds_until(None, NOON) is None
    nxt = schedule.evaluate(spec(NIGHT), None, NOON).next_transition
    assert schedule.seconds_until(nxt, NOON) == 9 * 3600


# --- the conditions while the worlds are meant to sleep ----------------------------------------


def by_type(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {condition["type"]: condition for condition in items}


def test_conditions_while_parking_then_asleep() -> None:
    intent = schedule.SleepIntent(True, 1, "spec.sleep")
    parking = [
        {"index": 0, "phase": "Sleeping", "admission": "parked", "message": "m"},
        {"index": 1, "phase": "Sleeping", "admission": "parking", "message": "draining"},
    ]
    items, phase = conditions.summarise(parking, 2, sleep=intent)
    found = by_type(items)
    assert phase == "Progressing"
    assert found["Ready"]["reason"] == "Sleeping" and found["Ready"]["status"] == "False"
    assert found["Progressing"]["reason"] == "WorldsParking" and "world 1" in found["Progressing"]["message"]
    assert found["Sleeping"]["status"] == "False"
    asleep = [dict(world, admission="parked") for world in parking]
    items, phase = conditions.summarise(asleep, 2, sleep=intent)
    found = by_type(items)
    assert phase == "Sleeping" and found["Sleeping"]["status"] == "True"
    assert found["Sleeping"]["message"].startswith("asleep at level 1 by spec.sleep: 2/2 engines parked")
    assert found["Progressing"]["status"] == "False"
    # A world that failed for good while asleep is still Degraded.
    items, phase = conditions.summarise([asleep[0], {"index": 1, "phase": "Failed"}], 2, sleep=intent)
    assert phase == "Degraded" and by_type(items)["Degraded"]["status"] == "True"


def test_a_world_asleep_against_the_intent_is_being_woken() -> None:
    items, phase = conditions.summarise(
        [{"index": 0, "phase": "Ready"}, {"index": 1, "phase": "Sleeping", "admission": "parked"}],
        2,
        sleep=schedule.SleepIntent(False),
    )
    assert phase == "Progressing" and by_type(items)["Progressing"]["reason"] == "WorldsWaking"
    items, _ = conditions.summarise(
        [{"index": 0, "phase": "Ready"}], 1, retiring=[{"index": 1, "message": "x"}]
    )
    assert by_type(items)["Progressing"]["reason"] == "WorldsRetiring"
