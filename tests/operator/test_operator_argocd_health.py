"""The Argo CD health check (manifests/argocd/health.lua) in Lua 5.1, as Argo CD runs it."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.support.argocd_health import ARGOCD, SCRIPT
from tests.support.argocd_health import argocd_health as health


def cr(generation: int = 2, observed: int | None = 2, **conditions: tuple[str, str, str]) -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [
            {"type": kind, "status": state, "reason": reason, "message": message}
            for kind, (state, reason, message) in conditions.items()
        ]
    }
    if observed is not None:
        status["observedGeneration"] = observed
    return {"metadata": {"name": "llama", "generation": generation}, "status": status}


READY = ("True", "AllWorldsReady", "2/2 worlds ready")
NOT_READY = ("False", "WorldsNotReady", "1/2 worlds ready")
AWAKE = ("False", "Awake", "0/2 engines parked")
NOT_DEGRADED = ("False", "RestartBudgetAvailable", "no world has used up its restarts")


def test_ready_and_current_is_healthy() -> None:
    assert health(cr(Ready=READY, Degraded=NOT_DEGRADED, Sleeping=AWAKE)) == {
        "status": "Healthy",
        "message": "2/2 worlds ready",
    }


def test_no_status_yet_is_progressing() -> None:
    assert health({"metadata": {"name": "llama", "generation": 1}})["status"] == "Progressing"


def test_unobserved_generation_is_progressing_even_when_ready() -> None:
    result = health(cr(generation=3, observed=2, Ready=READY))
    assert result == {
        "status": "Progressing",
        "message": "Waiting for the operator to reconcile generation 3",
    }
    assert health(cr(generation=3, observed=None, Ready=READY))["status"] == "Progressing"


def test_worlds_starting_is_progressing_with_the_operators_message() -> None:
    starting = ("True", "WorldsStarting", "world 1 Pending: launcher pod llama-w1-launcher is Pending")
    result = health(cr(Ready=NOT_READY, Progressing=starting, Degraded=NOT_DEGRADED))
    assert result == {"status": "Progressing", "message": starting[2]}


def test_exhausted_restarts_are_degraded_with_the_engine_error() -> None:
    error = "world 0 Failed: EngineDead: CUDA error: an illegal memory access was encountered; ..."
    result = health(cr(Ready=NOT_READY, Degraded=("True", "RestartBudgetExhausted", error), Sleeping=AWAKE))
    assert result == {"status": "Degraded", "message": error}


def test_sleeping_is_suspended() -> None:
    parked = ("True", "EnginesParked", "2/2 engines parked")
    assert health(cr(Ready=NOT_READY, Sleeping=parked, Degraded=NOT_DEGRADED)) == {
        "status": "Suspended",
        "message": "2/2 engines parked",
    }


def test_asleep_on_schedule_is_healthy_and_says_when_it_wakes() -> None:
    """The plan, not a decision someone made: nothing to look at, and no Suspended app that
    Argo CD would show as stopped every night."""
    parked = ("True", "ScheduledSleep", "asleep at level 1 by schedule night: 2/2 engines parked")
    obj = cr(Ready=NOT_READY, Sleeping=parked, Degraded=NOT_DEGRADED)
    obj["status"]["nextTransition"] = {"message": "Wake at 2026-06-02T04:00:00.000000Z (schedule morning)"}
    assert health(obj) == {
        "status": "Healthy",
        "message": f"{parked[2]}; next: Wake at 2026-06-02T04:00:00.000000Z (schedule morning)",
    }
    # On the way to sleep (not every engine parked yet) it is progressing, as any change is.
    parking = ("False", "Parking", "asleep at level 1 by schedule night: 1/2 engines parked")
    assert health(cr(Ready=NOT_READY, Sleeping=parking, Degraded=NOT_DEGRADED))["status"] == "Progressing"


def test_asleep_for_idleness_is_healthy() -> None:
    """spec.autoscaling put every world to sleep: the plan, the first request wakes it."""
    parked = ("True", "IdleSleep", "asleep at level 1 by autoscaling (idle): 1/1 engines parked")
    assert health(cr(Ready=NOT_READY, Sleeping=parked, Degraded=NOT_DEGRADED)) == {
        "status": "Healthy",
        "message": parked[2],
    }


def test_a_rollout_under_way_is_progressing_even_with_every_world_ready() -> None:
    obj = cr(Ready=READY, Degraded=NOT_DEGRADED, Sleeping=AWAKE)
    obj["status"]["rollout"] = {"target": "06c4", "done": [0], "inFlight": []}  # between two worlds
    assert health(obj) == {"status": "Progressing", "message": "rolling out 06c4: 1 world(s) done"}
    stopped = {"world": 1, "message": "world 1 did not become Ready on the new spec"}
    obj["status"]["rollout"]["failed"] = stopped
    assert health(obj) == {
        "status": "Degraded",
        "message": "rollout to 06c4 stopped: world 1 did not become Ready on the new spec",
    }
    obj["status"]["rollout"] = {"target": "06c4", "done": [0, 1], "inFlight": [], "complete": True}
    assert health(obj)["status"] == "Healthy"


def test_degraded_wins_over_sleeping() -> None:
    failed = ("True", "RestartBudgetExhausted", "boom")
    assert health(cr(Sleeping=("True", "EnginesParked", "x"), Degraded=failed))["status"] == "Degraded"


@pytest.mark.parametrize("key", ["resource.customizations.health.berth.dev_LLMDeployment"])
def test_argocd_cm_patch_carries_the_same_script(key: str) -> None:
    patch = yaml.safe_load((ARGOCD / "argocd-cm-patch.yaml").read_text())
    assert patch["metadata"] == {"name": "argocd-cm", "namespace": "argocd"}
    assert patch["data"][key] == SCRIPT


def test_example_application_points_at_argocd_and_leaves_replicas_to_kubectl_scale() -> None:
    app = yaml.safe_load((ARGOCD / "application.yaml").read_text())
    assert app["kind"] == "Application" and app["spec"]["syncPolicy"]["automated"]["selfHeal"] is True
    # `kubectl scale` / an HPA owns replicas once the object exists: neither drift nor a sync's
    # write-back (RespectIgnoreDifferences), or self-heal would undo every scale.
    assert {
        "group": "berth.dev",
        "kind": "LLMDeployment",
        "jsonPointers": ["/spec/replicas"],
    } in app["spec"]["ignoreDifferences"]
    assert "RespectIgnoreDifferences=true" in app["spec"]["syncPolicy"]["syncOptions"]
