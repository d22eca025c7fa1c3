"""`rollout.plan`, the pure heart of a rolling change: how many worlds it takes at once, what a
world that fails its rollout does to the rest, and how its memory resumes after a restart."""

from __future__ import annotations

import datetime as dt

from berth.operator import rollout
from berth.operator.restarts import format_time

NOW = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.timezone.utc)
TARGET = "spec-b"


def world(
    index: int, *, outdated: str | None = "launcher", phase: str = "Ready", admission: str = "running"
) -> rollout.WorldState:
    return rollout.WorldState(
        index=index,
        ready=phase == "Ready",
        phase=phase,
        admission=admission,
        outdated=outdated,
        busy=False,
    )


def plan(worlds: list[rollout.WorldState], memory: dict | None = None, **options) -> rollout.Plan:
    return rollout.plan(
        worlds,
        memory,
        TARGET,
        options.pop("max_unavailable", 1),
        NOW,
        drain_timeout=60,
        startup_timeout=120,
        **options,
    )


def reasons(result: rollout.Plan) -> list[str]:
    return [reason for _, reason, _ in result.events]


def test_one_world_at_a_time_by_default_and_more_with_max_unavailable() -> None:
    three = [world(0), world(1), world(2)]
    assert plan(three).orders == [(0, "drain")]
    assert plan(three, max_unavailable=2).orders == [(0, "drain"), (1, "drain")]
    # A world already out of service counts: with one down, nothing more is taken.
    down_elsewhere = [world(0), world(1), world(2, outdated=None, phase="NotReady")]
    assert plan(down_elsewhere).orders == []


def test_an_outdated_world_that_serves_nothing_is_replaced_at_once() -> None:
    result = plan([world(0), world(1, phase="BackingOff")])
    assert (1, "replace") in result.orders and (0, "drain") not in result.orders


def test_a_world_that_fails_its_rollout_stops_it_and_the_next_is_never_taken() -> None:
    started = plan([world(0), world(1)])
    failing = [world(0, outdated=None, phase="Failed", admission="failed"), world(1)]
    stopped = plan(failing, started.memory)
    assert stopped.memory["failed"] == {
        "world": 0,
        "message": "world 0 did not become Ready on the new spec (Failed)",
    }
    assert stopped.orders == [] and "RolloutFailed" in reasons(stopped)
    # Stopped stays stopped, round after round, until the spec changes again.
    again = plan(failing, stopped.memory)
    assert again.orders == [] and again.memory["failed"]["world"] == 0
    assert "complete" not in again.memory
    restarted = rollout.plan(failing, stopped.memory, "spec-c", 1, NOW, 60, 120)
    assert "failed" not in restarted.memory


def test_a_refused_swap_stops_the_rollout_and_wakes_the_world_on_its_old_weights() -> None:
    swapping = plan([world(0, outdated="model"), world(1, outdated="model")])
    assert swapping.orders == [(0, "swap-sleep")]
    parked = [world(0, outdated="model", phase="Sleeping", admission="parked"), world(1, outdated="model")]
    refused = plan(parked, swapping.memory, swap_refused={0: "the shapes differ"})
    assert refused.orders == [(0, "wake")]
    assert refused.memory["failed"]["message"] == "the engine refused the new model: the shapes differ"


def test_memory_resumes_without_skipping_or_repeating_a_world() -> None:
    first = plan([world(0), world(1)])
    # World 0 came back on the new spec; the operator restarted in between: the memory carries on.
    resumed = plan([world(0, outdated=None), world(1)], first.memory)
    assert resumed.memory["done"] == [0] and resumed.orders == [(1, "drain")]
    finished = plan([world(0, outdated=None), world(1, outdated=None)], resumed.memory)
    assert finished.memory["done"] == [0, 1] and finished.memory["complete"] is True
    assert finished.orders == [] and "RolloutComplete" in reasons(finished)
    # Nothing outdated and nothing in flight: a quiet round changes nothing.
    quiet = plan([world(0, outdated=None), world(1, outdated=None)], finished.memory)
    assert quiet.orders == [] and quiet.events == []


def test_a_drained_world_is_replaced_once_parked_or_when_the_drain_outlives_its_timeout() -> None:
    first = plan([world(0), world(1)])
    parked = plan([world(0, phase="Sleeping", admission="parked"), world(1)], first.memory)
    assert parked.orders == [(0, "replace")]
    (entry,) = first.memory["inFlight"]
    stale = {
        **first.memory,
        "inFlight": [{**entry, "drainingSince": format_time(NOW - dt.timedelta(seconds=91))}],
    }
    assert plan([world(0, phase="NotReady", admission="parking"), world(1)], stale).orders == [(0, "replace")]
