"""The operator's ledger of sleep / wakeup calls in flight: a world stays busy until the outcome
of its transition has been collected, so no decision is taken on a world whose outcome is unseen."""

from __future__ import annotations

import asyncio

from berth.operator.engine_admin import TransitionOutcome, Transitions


async def test_a_transition_that_ended_keeps_its_world_busy_until_its_outcome_is_collected() -> None:
    transitions = Transitions()
    answer: asyncio.Future[TransitionOutcome] = asyncio.get_running_loop().create_future()
    transitions.start(2, "sleep", "retire", answer)
    await asyncio.sleep(0)
    assert transitions.busy(2) and transitions.finished() == []

    done = TransitionOutcome("sleep", True, "done", "sleep done", 0.5)
    answer.set_result(done)
    _, _, call = transitions.tasks[2]
    await asyncio.wait_for(call, 5)  # the call has ended: a round that began before still sees it busy
    assert transitions.busy(2)
    assert transitions.finished() == [(2, "retire", done)]
    assert not transitions.busy(2) and transitions.finished() == []


async def test_a_transition_that_ends_wakes_the_health_loop_however_it_ends() -> None:
    ended: list[int] = []
    transitions = Transitions(on_end=lambda: ended.append(len(ended)))
    answer: asyncio.Future[TransitionOutcome] = asyncio.get_running_loop().create_future()
    transitions.start(0, "sleep", "rollout", answer)
    failing: asyncio.Future[TransitionOutcome] = asyncio.get_running_loop().create_future()
    transitions.start(1, "wakeup", "wake", failing)
    await asyncio.sleep(0)
    assert ended == []  # in flight: nothing to look at yet

    answer.set_result(TransitionOutcome("sleep", True, "done", "sleep done", 0.5))
    await asyncio.wait_for(transitions.tasks[0][2], 5)
    assert ended == [0]
    failing.set_exception(ValueError("no JSON"))
    # An error ends it too (its outcome says "failed").
    await asyncio.wait([transitions.tasks[1][2]], timeout=5)
    assert ended == [0, 1]
    assert [outcome.result for _, _, outcome in transitions.finished()] == ["done", "failed"]
