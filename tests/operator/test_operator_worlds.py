"""The world state machine, the restart policy and the conditions, without a cluster."""

from __future__ import annotations

import datetime as dt
from typing import Any

from berth.operator import conditions, restarts, worlds
from berth.operator.crd_model import parse_spec
from berth.operator.health import Probe

T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.timezone.utc)
SPEC = parse_spec(
    {
        "model": {"path": "/m"},
        "image": "berth:1",
        "tensorParallelSize": 2,
        "gpusPerNode": 1,
        "health": {
            "failureThreshold": 2,
            "maxRestarts": 3,
            "restartWindowSeconds": 600,
            "backoffSeconds": 10,
        },
    }
)
POLICY = restarts.RestartPolicy.from_spec(SPEC.health)


def pod(
    name: str, uid: str, phase: str = "Running", restarts_: int = 0, role: str = "worker", **status: Any
) -> dict:
    return {
        "metadata": {"name": name, "uid": uid, "labels": {"berth.dev/role": role, "berth.dev/world": "0"}},
        "status": {
            "phase": phase,
            "podIP": "10.0.0.1",
            "containerStatuses": [
                {"name": role, "restartCount": restarts_, "state": status.get("state", {})}
            ],
        },
    }


LAUNCHER = pod("d-w0-launcher", "L1", role="launcher")
WORKERS = [pod("d-w0-0", "W0"), pod("d-w0-1", "W1")]


def view(
    launcher: dict | None = LAUNCHER, workers: list | None = None, members: dict | None = None
) -> worlds.PodView:
    return worlds.view_pods("d", 0, launcher, WORKERS if workers is None else workers, 2, members or {})


ALIVE = Probe("alive", ready=True, admission="running")
DEAD = Probe("dead", error="CUDA error: an illegal memory access was encountered")
SILENT = Probe("unreachable", error="ConnectError: connection refused")


def step(previous: dict, probe: Probe | None, pods: worlds.PodView | None = None, now: dt.datetime = T0):
    return worlds.step(0, previous, pods or view(), probe, now, SPEC, "d")


# --- restart policy --------------------------------------------------------------------------


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = restarts.RestartPolicy(
        max_restarts=10, window_seconds=3600, backoff_seconds=10, max_backoff_seconds=35
    )
    assert [restarts.backoff_delay(n, policy) for n in range(5)] == [0, 10, 20, 35, 35]


def test_decide_restart_wait_exhausted_and_refill() -> None:
    stamp = restarts.format_time
    assert restarts.decide([], T0, POLICY) == restarts.RestartDecision("restart", 0.0, 0)
    one = [stamp(T0)]
    assert restarts.decide(one, T0 + dt.timedelta(seconds=4), POLICY) == restarts.RestartDecision(
        "wait", 6.0, 1
    )
    assert restarts.decide(one, T0 + dt.timedelta(seconds=10), POLICY).action == "restart"
    three = [stamp(T0), stamp(T0 + dt.timedelta(seconds=10)), stamp(T0 + dt.timedelta(seconds=30))]
    exhausted = restarts.decide(three, T0 + dt.timedelta(seconds=100), POLICY)
    assert exhausted == restarts.RestartDecision("exhausted", 500.0, 3)
    assert restarts.world_restart_budget_exhausted(three, T0 + dt.timedelta(seconds=100), POLICY)
    # The oldest restart leaves the window: the budget has room again.
    assert restarts.decide(three, T0 + dt.timedelta(seconds=601), POLICY).action == "restart"


# --- pods --------------------------------------------------------------------------------------


def test_pods_running_or_waiting() -> None:
    assert view().running and view().failure is None
    assert view(launcher=None).waiting == "launcher pod d-w0-launcher does not exist yet"
    assert "1/2 worker pods" in view(workers=WORKERS[:1]).waiting
    pending = view(workers=[WORKERS[0], pod("d-w0-1", "W1", phase="Pending")])
    assert not pending.running and pending.waiting == "worker pods not running yet: d-w0-1"
    assert view().snapshot == {"d-w0-launcher": "L1/0", "d-w0-0": "W0/0", "d-w0-1": "W1/0"}


def test_pod_failures() -> None:
    terminated = {"terminated": {"exitCode": 137, "reason": "OOMKilled", "message": "out of memory"}}
    failed_launcher = pod("d-w0-launcher", "L1", phase="Failed", role="launcher", state=terminated)
    failed_launcher["spec"] = {"nodeName": "cpu-node-1"}
    # The kernel's OOM killer is its own reason (the fix is memory, not code), with the node.
    assert view(launcher=failed_launcher).failure == worlds.Failure(
        "OOMKilled",
        "launcher pod d-w0-launcher: container launcher exited with code 137 (OOMKilled): out of memory",
        "cpu-node-1",
    )
    oom_worker = view(workers=[WORKERS[0], pod("d-w0-1", "W1", phase="Failed", state=terminated)])
    assert oom_worker.failure is not None and oom_worker.failure.reason == "OOMKilled"
    crashed = {"terminated": {"exitCode": 134, "reason": "Error", "message": "CUDA error"}}
    failed_worker = view(workers=[WORKERS[0], pod("d-w0-1", "W1", phase="Failed", state=crashed)])
    assert failed_worker.failure is not None and failed_worker.failure.reason == "WorkerFailed"
    members = view().snapshot
    replaced = view(workers=[WORKERS[0], pod("d-w0-1", "W1-new")], members=members)
    assert replaced.failure == worlds.Failure(
        "WorkerRestarted", "pod d-w0-1 was deleted or replaced while the world ran"
    )
    restarted = view(workers=[WORKERS[0], pod("d-w0-1", "W1", restarts_=1)], members=members)
    assert restarted.failure is not None and restarted.failure.reason == "WorkerRestarted"
    assert view(launcher=None, members=members).failure.reason == "LauncherGone"
    assert view(members=members).failure is None


def test_a_launcher_that_exits_0_ends_its_world() -> None:
    completed = {"terminated": {"exitCode": 0, "reason": "Completed"}}
    done = pod("d-w0-launcher", "L1", phase="Succeeded", role="launcher", state=completed)
    ended = view(launcher=done, members=view().snapshot)
    assert ended.failure == worlds.Failure(
        "LauncherExited",
        "launcher pod d-w0-launcher ended on its own: container launcher exited with code 0 (Completed)",
    )
    result = step({"phase": "Ready", "members": view().snapshot}, None, ended)
    assert result.restart is not None and result.restart.reason == "LauncherExited"
    assert result.status["restarts"] == 1


# --- one world, poll by poll -----------------------------------------------------------------


def test_alive_world_is_ready_and_remembers_its_members() -> None:
    result = step({}, ALIVE)
    assert result.restart is None
    assert result.status["phase"] == "Ready" and result.status["ready"] is True
    assert result.status["members"] == view().snapshot
    assert result.events == [("Normal", "WorldReady", "world 0 is ready")]
    assert step(result.status | {"phase": "Ready"}, ALIVE).events == []  # no event without a change


def test_not_admitting_is_not_ready() -> None:
    result = step({}, Probe("alive", ready=False, admission="shutdown"))
    assert result.status["phase"] == "NotReady" and result.status["admission"] == "shutdown"


def test_a_sleeping_engine_is_up_but_not_ready_and_reports_its_revision() -> None:
    parked = Probe("alive", ready=False, admission="parked", model_revision="/m@sha256:ab", sleep_level=2)
    result = step({}, parked)
    assert result.status["phase"] == "Sleeping" and not result.status["ready"]
    assert result.status["modelRevision"] == "/m@sha256:ab" and result.status["sleepLevel"] == 2
    assert "asleep at level 2" in result.status["message"]
    assert step({}, Probe("alive", ready=False, admission="waking")).status["phase"] == "Waking"
    # Asleep counts as up: a sleeping world that stops answering is on its way to a restart.
    silent = step(result.status | {"phase": "Sleeping"}, SILENT)
    assert silent.status["phase"] == "Unreachable" and silent.status["probeFailures"] == 1


def test_unanswered_polls_count_only_after_the_world_was_up() -> None:
    assert step({"phase": "Pending"}, SILENT).status["phase"] == "Starting"
    first = step({"phase": "Ready"}, SILENT)
    assert (
        first.status["phase"] == "Unreachable"
        and first.status["probeFailures"] == 1
        and first.restart is None
    )
    second = step(first.status, SILENT)
    assert second.restart is not None and second.restart.reason == "Unreachable"


def test_an_unreachable_launcher_the_kubelet_reports_ready_is_reported_not_restarted() -> None:
    ready_launcher = pod("d-w0-launcher", "L1", role="launcher")
    ready_launcher["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    pods = view(ready_launcher)
    assert pods.launcher_ready and not view().launcher_ready
    first = step({"phase": "Ready"}, SILENT, pods)
    second = step(first.status, SILENT, pods)
    third = step(second.status, SILENT, pods)
    assert second.restart is None and third.restart is None  # the threshold (2) passed: no restart
    assert third.status["phase"] == "Unreachable" and third.status["probeFailures"] == 3
    assert "reports its pod Ready: not restarted" in third.status["message"]
    # One Event when the second opinion first holds, not one per poll; one when it answers again.
    assert [event[1] for event in (*first.events, *second.events, *third.events)] == ["WorldUnreachable"]
    back = step(third.status, ALIVE, pods)
    assert back.status["phase"] == "Ready" and back.status["probeFailures"] == 0
    assert [event[1] for event in back.events] == ["WorldReachable", "WorldReady"]
    # The deployment's Unreachable condition follows the world.
    conds, _ = conditions.summarise([third.status], 1)
    assert conditions.find(conds, "Unreachable")["status"] == "True"
    conds, _ = conditions.summarise([back.status], 1)
    assert conditions.find(conds, "Unreachable")["status"] == "False"


def test_engine_death_restarts_then_backs_off_then_gives_up() -> None:
    first = step({"phase": "Ready", "members": view().snapshot}, DEAD)
    assert first.restart == worlds.Failure("EngineDead", DEAD.error)
    status = first.status
    assert status["phase"] == "Restarting" and status["restarts"] == 1 and status["members"] == {}
    assert status["lastEngineError"] == DEAD.error and status["lastRestartReason"] == "EngineDead"
    assert first.events == [("Warning", "WorldRestarted", f"world 0 restarted (EngineDead): {DEAD.error}")]

    early = step(status | {"phase": "Ready"}, DEAD, now=T0 + dt.timedelta(seconds=3))
    assert early.restart is None and early.status["phase"] == "BackingOff"
    assert "restarting in 7s (restart 2 of 3 within 600s)" in early.status["message"]

    second = step(early.status, DEAD, now=T0 + dt.timedelta(seconds=10))
    assert second.restart is not None and second.status["restarts"] == 2
    third = step(second.status | {"phase": "Ready"}, DEAD, now=T0 + dt.timedelta(seconds=40))
    assert third.restart is not None and third.status["restarts"] == 3

    gave_up = step(third.status | {"phase": "Ready"}, DEAD, now=T0 + dt.timedelta(seconds=100))
    assert gave_up.restart is None and gave_up.status["phase"] == "Failed"
    assert DEAD.error in gave_up.status["message"] and "health.maxRestarts=3" in gave_up.status["message"]
    assert gave_up.events == [
        ("Warning", "RestartBudgetExhausted", f"world 0 gave up after EngineDead: {DEAD.error}")
    ]
    # Still dead a poll later: no second event, no restart.
    again = step(gave_up.status, DEAD, now=T0 + dt.timedelta(seconds=101))
    assert again.restart is None and again.events == [] and again.status["restarts"] == 3
    # The window slides past the first restart: one more try.
    assert step(gave_up.status, DEAD, now=T0 + dt.timedelta(seconds=601)).restart is not None


# --- conditions --------------------------------------------------------------------------------


def world(index: int, phase: str, message: str = "", admission: str | None = None) -> dict[str, Any]:
    result = {"index": index, "phase": phase, "message": message}
    if admission:
        result["admission"] = admission
    return result


def by_type(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {condition["type"]: condition for condition in items}


def test_conditions_all_ready() -> None:
    items, phase = conditions.summarise([world(0, "Ready"), world(1, "Ready")], 2)
    found = by_type(items)
    assert phase == "Ready"
    assert found["Ready"] == {
        "type": "Ready",
        "status": "True",
        "reason": "AllWorldsReady",
        "message": "2/2 worlds ready",
    }
    assert found["Progressing"]["status"] == "False" and found["Degraded"]["status"] == "False"
    assert list(found) == list(conditions.CONDITION_TYPES)


def test_conditions_starting_and_failed() -> None:
    items, phase = conditions.summarise(
        [world(0, "Ready"), world(1, "Pending", "launcher pod x is Pending")], 2
    )
    found = by_type(items)
    assert phase == "Progressing" and found["Available"]["status"] == "True"
    assert found["Progressing"]["reason"] == "WorldsStarting"
    assert found["Progressing"]["message"] == "world 1 Pending: launcher pod x is Pending"
    items, phase = conditions.summarise([world(0, "Failed", "EngineDead: boom")], 1)
    found = by_type(items)
    assert phase == "Degraded"
    assert (
        found["Degraded"]["reason"] == "RestartBudgetExhausted"
        and "EngineDead: boom" in found["Degraded"]["message"]
    )
    assert found["Available"]["reason"] == "NoWorldReady"


def test_conditions_sleeping_and_invalid() -> None:
    items, phase = conditions.summarise([world(0, "NotReady", admission="parked")], 1)
    assert phase == "Sleeping" and by_type(items)["Sleeping"]["status"] == "True"
    items, phase = conditions.summarise([], 0, invalid_spec="spec.replicas: too small")
    assert phase == "Degraded" and by_type(items)["Degraded"]["reason"] == "InvalidSpec"


def test_transition_times_move_only_on_change() -> None:
    first = conditions.merge_conditions(None, conditions.summarise([world(0, "Pending")], 1)[0], T0, 1)
    later = T0 + dt.timedelta(minutes=1)
    same = conditions.merge_conditions(first, conditions.summarise([world(0, "Pending")], 1)[0], later, 2)
    assert by_type(same)["Ready"]["lastTransitionTime"] == restarts.format_time(T0)
    assert by_type(same)["Ready"]["observedGeneration"] == 2
    changed = conditions.merge_conditions(first, conditions.summarise([world(0, "Ready")], 1)[0], later, 2)
    assert by_type(changed)["Ready"]["lastTransitionTime"] == restarts.format_time(later)
