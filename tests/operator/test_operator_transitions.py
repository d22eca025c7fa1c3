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
