"""kstatus (tests/support/kstatus.py) on the conditions the operator computes: Current when every
world serves this spec, InProgress while it works toward it (worlds starting, a rollout, a spec
not reconciled yet), Failed when it cannot get there alone (an invalid spec, an object in the
way, a rollout stopped on a world, a world out of restarts). Every condition carries the
generation it was computed for. The integration tests judge the statuses the running operator
writes the same way (test_operator_rollout.py, test_operator_children.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from berth.operator import conditions
from tests.support.kstatus import kstatus

NOW = dt.datetime(2026, 12, 5, tzinfo=dt.timezone.utc)
READY = {"index": 0, "phase": "Ready", "admission": "running"}
ROLLING = {"target": "abc", "done": [0], "inFlight": [{"world": 1, "step": "draining"}]}


def judged(worlds: list[dict[str, Any]], desired: int, generation: int = 3, **kwargs: Any) -> dict[str, Any]:
    conds, phase = conditions.summarise(worlds, desired, **kwargs)
    stamped = conditions.merge_conditions([], conds, NOW, generation)
    assert all(condition["observedGeneration"] == generation for condition in stamped)
    return {
        "metadata": {"generation": generation},
        "status": {"observedGeneration": generation, "conditions": stamped, "phase": phase},
    }


def state(obj: dict[str, Any], kind: str) -> str:
    return next(c["status"] for c in obj["status"]["conditions"] if c["type"] == kind)


def test_every_world_on_this_spec_is_current_and_ready() -> None:
    obj = judged(
        [READY, {**READY, "index": 1}], 2, rollout={"target": "abc", "done": [0, 1], "complete": True}
    )
    assert kstatus(obj)[0] == "Current" and state(obj, "Ready") == "True"
    assert state(obj, "Reconciling") == "False" and state(obj, "Stalled") == "False"


def test_a_rollout_under_way_is_in_progress_and_not_ready_even_with_every_world_ready() -> None:
    obj = judged([READY, {**READY, "index": 1}], 2, rollout=ROLLING)
    assert kstatus(obj) == ("InProgress", "rolling out: 1 world(s) done; world 1 draining")
    ready = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "RolloutInProgress")


def test_a_spec_not_reconciled_yet_is_in_progress() -> None:
    obj = judged([READY], 1, reconciled=False)
    assert kstatus(obj)[0] == "InProgress" and state(obj, "Ready") == "False"
    # And a status from before the spec changed says so through observedGeneration alone.
    obj["metadata"]["generation"] = 4
    assert kstatus(obj)[0] == "InProgress"


def test_worlds_starting_are_in_progress() -> None:
    obj = judged([{"index": 0, "phase": "Starting", "message": "engine loading"}], 1)
    assert kstatus(obj)[0] == "InProgress"


def test_what_needs_a_human_is_failed() -> None:
    failed_world = {"index": 0, "phase": "Failed", "message": "EngineDead: out of restarts"}
    cases = {
        "invalid": judged([], 0, invalid_spec="spec.replicas: bad"),
        "conflict": judged([READY], 1, conflicts=["Service/llama exists and is controlled by nobody"]),
        "rollout": judged([READY], 1, rollout={**ROLLING, "failed": {"world": 0, "message": "refused"}}),
        "budget": judged([failed_world], 1),
    }
    for name, obj in cases.items():
        assert kstatus(obj)[0] == "Failed", name
        assert state(obj, "Reconciling") == "False" and state(obj, "Ready") == "False", name
