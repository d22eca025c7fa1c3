"""Manual and scheduled sleep through the operator, against a real `berth serve` per launcher:
the operator drives the engine's /admin/sleep and /admin/wakeup, the status and the shipped
Argo CD health check follow (Suspended while asleep, Healthy once awake), no pod restarts."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from berth.operator.restarts import parse_time
from tests.support.argocd_health import argocd_health
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.operator_runner import ShiftedClock, running_operator

LLMD = "berth.dev/v1alpha1/llmdeployments"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"
TRANSITION_TIMEOUT = 60.0


async def apply_one_world(cluster: Cluster, tmp_path: Path, interval: int = 1, **spec: Any) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(replicas=1, frontends=0, **spec)
    doc["spec"]["health"] = {"intervalSeconds": interval, "timeoutSeconds": 1, "failureThreshold": 3}
    doc["spec"].pop("sleepSchedules", None)
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(doc))
    await cluster.kubectl("apply", "--validate=false", "-f", str(path))


def llmd(cluster: Cluster) -> dict[str, Any]:
    return cluster.get(LLMD, "llama") or {}


def status(cluster: Cluster) -> dict[str, Any]:
    return llmd(cluster).get("status") or {}


def world(cluster: Cluster) -> dict[str, Any]:
    return (status(cluster).get("worlds") or [{}])[0]


def condition(cluster: Cluster, kind: str) -> dict[str, Any]:
    return next((c for c in status(cluster).get("conditions") or [] if c["type"] == kind), {})


def sleeping_condition(cluster: Cluster) -> dict[str, Any]:
    return next((c for c in status(cluster).get("conditions") or [] if c["type"] == "Sleeping"), {})


def ready_condition(cluster: Cluster) -> str | None:
    ready = next((c for c in status(cluster).get("conditions") or [] if c["type"] == "Ready"), {})
    return ready.get("status")


def health(cluster: Cluster) -> str:
    return argocd_health(llmd(cluster))["status"]


def events(cluster: Cluster, reason: str) -> list[str]:
    return [event["message"] for event in cluster.objects("v1/events") if event.get("reason") == reason]


def pod_uids(cluster: Cluster) -> dict[str, str]:
    return {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.objects("v1/pods")}


def transitions(transition: str, purpose: str, result: str = "done") -> float:
    labels = {
        "namespace": "default",
        "deployment": "llama",
        "transition": transition,
        "purpose": purpose,
        "result": result,
    }
    return REGISTRY.get_sample_value("berth_operator_engine_transitions_total", labels) or 0.0


async def patch_spec(cluster: Cluster, spec: dict[str, Any]) -> None:
    await cluster.kubectl("patch", "llmd", "llama", "--type=merge", "-p", yaml.safe_dump({"spec": spec}))


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_manual_sleep_is_suspended_then_wakes_healthy_in_the_same_processes(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    sleeps, wakeups = transitions("sleep", "sleep"), transitions("wakeup", "wake")
    async with running_operator(cluster, fleet.resolve):
        await apply_one_world(cluster, tmp_path)
        await wait_for(lambda: health(cluster) == "Healthy", START_TIMEOUT, "Healthy")
        engine = fleet.for_pod("llama-w0-launcher")
        pid, uids = await engine.engine_pid(), pod_uids(cluster)
        assert world(cluster)["modelRevision"].startswith(f"{fleet.model}@sha256:")
        assert status(cluster)["modelRevision"] == world(cluster)["modelRevision"]

        await patch_spec(cluster, {"sleep": {"sleeping": True, "level": 2}})
        await wait_for(lambda: health(cluster) == "Suspended", TRANSITION_TIMEOUT, "Suspended")
        asleep_object = llmd(cluster)
        asleep = asleep_object["status"]
        sleeping_message = next(c for c in asleep["conditions"] if c["type"] == "Sleeping")["message"]
        assert (await engine.get("/ready")).status_code == 503  # out of the Service
        assert (await engine.get("/admin/state")).json()["sleep_level"] == 2

        await patch_spec(cluster, {"sleep": {"sleeping": False}})
        await wait_for(lambda: health(cluster) == "Healthy", TRANSITION_TIMEOUT, "Healthy after the wakeup")
        assert (await engine.get("/ready")).status_code == 200
        # Slept and woken in place: the same pods, the same engine process.
        assert await engine.engine_pid() == pid and pod_uids(cluster) == uids

    assert asleep["phase"] == "Sleeping"
    ready = next(c for c in asleep["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "Sleeping"
    assert ready["message"].startswith("asleep at level 2 by spec.sleep: 1/1 engines parked")
    (asleep_world,) = asleep["worlds"]
    assert asleep_world["phase"] == "Sleeping" and asleep_world["admission"] == "parked"
    assert asleep_world["sleepLevel"] == 2
    assert (
        asleep_world["lastTransition"]["kind"] == "sleep"
        and asleep_world["lastTransition"]["result"] == "done"
    )
    awake = world(cluster)
    assert awake["phase"] == "Ready" and awake["lastTransition"]["kind"] == "wakeup"
    assert events(cluster, "Sleeping") == [
        "world 0: sleeping at level 2 (spec.sleep); requests in flight get up to 300s to finish"
    ]
    assert [m.split(" in ")[0] for m in events(cluster, "WorldAsleep")] == ["world 0: sleep done"]
    assert len(events(cluster, "Waking")) == 1 and len(events(cluster, "WorldAwake")) == 1
    assert transitions("sleep", "sleep") == sleeps + 1 and transitions("wakeup", "wake") == wakeups + 1
    assert fleet.started == ["llama-w0-launcher"]

    # The operator's own status, one generation on: Progressing until the reconcile has seen it,
    # and still Progressing until the health daemon's conditions have judged it.
    healthy = llmd(cluster)
    generation = healthy["metadata"]["generation"]
    newer = {**healthy, "metadata": {**healthy["metadata"], "generation": generation + 1}}
    assert argocd_health(newer) == {
        "status": "Progressing",
        "message": f"Waiting for the operator to reconcile generation {generation + 1}",
    }
    reconciled = {**newer, "status": {**healthy["status"], "observedGeneration": generation + 1}}
    assert argocd_health(reconciled) == {
        "status": "Progressing",
        "message": f"Waiting for the operator to report on generation {generation + 1}",
    }
    assert argocd_health(asleep_object) == {"status": "Suspended", "message": sleeping_message}


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_schedule_fires_at_its_time_not_a_poll_later(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    clock = ShiftedClock()
    # Polls every 10 s once the world is settled: a firing must not wait for the next poll.
    interval = 10
    night = dt.datetime(2026, 6, 1, 20, 0, tzinfo=dt.timezone.utc)  # 22:00 in Berlin (CEST)
    morning = dt.datetime(2026, 6, 2, 4, 0, tzinfo=dt.timezone.utc)
    schedules = [
        {"name": "night", "cron": "0 22 * * *", "timezone": "Europe/Berlin", "action": "Sleep", "level": 1},
        {"name": "morning", "cron": "0 6 * * *", "timezone": "Europe/Berlin", "action": "Wake"},
    ]
    async with running_operator(cluster, fleet.resolve, clock=clock):
        clock.set(night - dt.timedelta(hours=1))
        await apply_one_world(cluster, tmp_path, interval=interval)
        await wait_for(lambda: health(cluster) == "Healthy", START_TIMEOUT, "Healthy")
        clock.set(night - dt.timedelta(seconds=5))
        await patch_spec(cluster, {"sleepSchedules": schedules})
        await wait_for(lambda: status(cluster).get("nextTransition"), 3 * interval, "nextTransition")
        upcoming = status(cluster)["nextTransition"]
        await wait_for(lambda: sleeping_condition(cluster)["status"] == "True", TRANSITION_TIMEOUT, "asleep")
        slept = status(cluster)
        on_schedule = argocd_health(llmd(cluster))

        clock.set(morning - dt.timedelta(seconds=3))
        await wait_for(
            lambda: sleeping_condition(cluster)["status"] == "False" and ready_condition(cluster) == "True",
            TRANSITION_TIMEOUT,
            "awake by the schedule",
        )
        woke = status(cluster)

    assert upcoming == {
        "schedule": "night",
        "action": "Sleep",
        "level": 1,
        "time": "2026-06-01T20:00:00.000000Z",
        "message": "Sleep at level 1 at 2026-06-01T20:00:00.000000Z (schedule night)",
    }
    fired = slept["sleepSchedule"]["lastFiring"]
    assert (fired["schedule"], fired["time"]) == ("night", "2026-06-01T20:00:00.000000Z")
    # Within a tick of its time: the health loop woke up for the firing (polls are 10 s apart).
    lag = (parse_time(fired["appliedAt"]) - night).total_seconds()
    assert 0 <= lag < 2.0, lag
    assert slept["nextTransition"]["schedule"] == "morning"
    sleeping = next(c for c in slept["conditions"] if c["type"] == "Sleeping")
    assert sleeping["status"] == "True" and "by schedule night" in sleeping["message"]
    assert sleeping["reason"] == "ScheduledSleep"
    # Asleep as planned: Healthy in Argo CD, saying when the schedule wakes it.
    assert on_schedule["status"] == "Healthy", on_schedule
    assert "by schedule night" in on_schedule["message"]
    assert on_schedule["message"].endswith("next: Wake at 2026-06-02T04:00:00.000000Z (schedule morning)")
    assert events(cluster, "Sleeping") == [
        "world 0: sleeping at level 1 (schedule night); requests in flight get up to 300s to finish"
    ]
    woken = woke["sleepSchedule"]["lastFiring"]
    assert woken["schedule"] == "morning" and woken["time"] == "2026-06-02T04:00:00.000000Z"
    assert (parse_time(woken["appliedAt"]) - morning).total_seconds() < interval + 2.0
    assert woke["nextTransition"]["time"] == "2026-06-02T20:00:00.000000Z"
