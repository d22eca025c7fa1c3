"""Dead worlds against real processes: the launcher address is a server on 127.0.0.1 whose
engine is a separate process; `kill -9` of that process must restart the whole world.

Each launcher pod's address is a real `berth serve` (tests/support/engine_endpoint.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY

from berth.operator.kube import Kube
from berth.operator.restarts import parse_time
from tests.support.cluster import Cluster, ClusterSim, sampling, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.operator_runner import running_operator
from tests.support.rbac import attributes

LLMD = "berth.dev/v1alpha1/llmdeployments"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"


async def apply_small_example(cluster: Cluster, tmp_path: Path, **health: int) -> None:
    """The annotated example, shrunk to one world of two workers and fast health polls."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(replicas=1, frontends=0)
    doc["spec"]["health"] = {"intervalSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 2, **health}
    path = tmp_path / "llama-small.yaml"
    path.write_text(yaml.safe_dump(doc))
    await cluster.kubectl("apply", "--validate=false", "-f", str(path))


def world(cluster: Cluster) -> dict[str, Any]:
    status = (cluster.get(LLMD, "llama") or {}).get("status") or {}
    return (status.get("worlds") or [{}])[0]


def condition(cluster: Cluster, kind: str) -> dict[str, Any]:
    status = (cluster.get(LLMD, "llama") or {}).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def lists_of_pods(cluster: Cluster) -> int:
    """LISTs of pods or StatefulSets the operator has sent (its watches are not counted)."""
    return sum(
        1
        for request in list(cluster.emulator)
        if request.headers.get("User-Agent", "").startswith(("kopf/", Kube.USER_AGENT))
        and (wanted := attributes(request)) is not None
        and wanted.verb == "list"
        and wanted.resource in ("pods", "statefulsets")
    )


def uid(cluster: Cluster, pod: str) -> str | None:
    obj = cluster.get("v1/pods", pod)
    return obj["metadata"]["uid"] if obj else None


def new_running_pod(cluster: Cluster, name: str, old_uid: str | None) -> bool:
    pod = cluster.get("v1/pods", name) or {"metadata": {}}
    return (
        pod["metadata"].get("uid") not in (None, old_uid) and pod.get("status", {}).get("phase") == "Running"
    )


def ready_after(cluster: Cluster, restarts: int) -> bool:
    current = world(cluster)
    return current.get("phase") == "Ready" and current.get("restarts") == restarts


def restarts_metric(reason: str) -> float:
    labels = {"namespace": "default", "deployment": "llama", "reason": reason}
    return REGISTRY.get_sample_value("berth_operator_world_restarts_total", labels) or 0.0


def warnings(cluster: Cluster, reason: str) -> list[str]:
    return [
        event["message"]
        for event in cluster.objects("v1/events")
        if event.get("reason") == reason and event.get("type") == "Warning"
    ]


@contextlib.asynccontextmanager
async def phase_recorder(cluster: Cluster) -> AsyncIterator[list[str]]:
    """Every world phase seen, sampled every 50 ms, without repeats."""
    seen: list[str] = []

    def sample() -> None:
        phase = world(cluster).get("phase")
        if phase and (not seen or seen[-1] != phase):
            seen.append(phase)

    async with sampling(sample, 0.05):
        yield seen


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_kill_9_of_the_engine_restarts_the_whole_world(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    before = restarts_metric("EngineDead")
    dead_probes = REGISTRY.get_sample_value(
        "berth_operator_health_probe_duration_seconds_count", {"result": "dead"}
    )
    async with running_operator(cluster, fleet.resolve):
        await apply_small_example(cluster, tmp_path)
        await wait_for(lambda: ready_after(cluster, 0), START_TIMEOUT, "the world Ready")
        old = {pod: uid(cluster, pod) for pod in ("llama-w0-launcher", "llama-w0-0", "llama-w0-1")}
        # The health rounds (1 s apart) read pods and StatefulSets from the watches: no LIST.
        listed = lists_of_pods(cluster)
        polls = REGISTRY.get_sample_value(
            "berth_operator_health_probe_duration_seconds_count", {"result": "alive"}
        )
        await asyncio.sleep(3.5)
        assert lists_of_pods(cluster) == listed
        polled = REGISTRY.get_sample_value(
            "berth_operator_health_probe_duration_seconds_count", {"result": "alive"}
        )
        assert polled >= polls + 3

        pid = await fleet.for_pod("llama-w0-launcher").kill_engine()
        await wait_for(lambda: ready_after(cluster, 1), START_TIMEOUT, "Ready after one restart")

    expected_error = f"WorkerDiedError: the worker process {pid} was killed by signal 9 (SIGKILL)"
    restarted = world(cluster)
    assert restarted["lastRestartReason"] == "EngineDead"
    assert restarted["lastEngineError"] == expected_error
    assert restarted["recentRestarts"] == [
        {"time": restarted["lastRestartTime"], "reason": "EngineDead", "error": expected_error, "node": None}
    ]  # the simulated kubelet binds no node (tests/operator/test_e2e_worlds.py has one)
    # Whole world: the launcher and both workers are new pods, under the same names.
    for pod, old_uid in old.items():
        assert uid(cluster, pod) not in (None, old_uid), f"{pod} was not replaced"
    assert fleet.started == ["llama-w0-launcher", "llama-w0-launcher"]
    assert [f"world 0 restarted (EngineDead): {expected_error}"] == warnings(cluster, "WorldRestarted")
    assert restarts_metric("EngineDead") == before + 1
    assert (
        REGISTRY.get_sample_value("berth_operator_health_probe_duration_seconds_count", {"result": "dead"})
        == (dead_probes or 0) + 1
    )
    assert condition(cluster, "Ready")["status"] == "True"


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_stalled_engine_restarts_the_world_with_reason_stalled(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    """SIGSTOP of the engine's worker while it has a request: alive, silent; the launcher's
    /health says "stalled" within its stall timeout and the world is restarted for it."""
    before = restarts_metric("Stalled")
    fleet.engine_args = ("--stall-timeout", "2")
    async with running_operator(cluster, fleet.resolve):
        await apply_small_example(cluster, tmp_path)
        await wait_for(lambda: ready_after(cluster, 0), START_TIMEOUT, "the world Ready")
        launcher = fleet.for_pod("llama-w0-launcher")
        pid = await launcher.engine_pid()
        async with httpx.AsyncClient() as client:
            # 408 tokens: within the fleet's 32 KV blocks of 16.
            body = {"model": str(fleet.model), "prompt": [5] * 8, "max_tokens": 400, "ignore_eos": True}
            async with client.stream(
                "POST", f"{launcher.url}/v1/completions", json={**body, "stream": True}, timeout=60
            ) as response:
                assert response.status_code == 200
                await anext(response.aiter_lines())  # the engine is stepping
                os.kill(pid, signal.SIGSTOP)
                try:
                    await wait_for(lambda: ready_after(cluster, 1), START_TIMEOUT, "Ready after one restart")
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)

    restarted = world(cluster)
    assert restarted["lastRestartReason"] == "Stalled", restarted
    assert [record["reason"] for record in restarted["recentRestarts"]] == ["Stalled"]  # in its history
    assert restarted["lastEngineError"].startswith("EngineStalledError: stalled: no step completed in 2 s")
    assert f"rank 0 (pid {pid}) is stopped (SIGSTOP)" in restarted["lastEngineError"]
    expected_event = f"world 0 restarted (Stalled): {restarted['lastEngineError']}"
    assert warnings(cluster, "WorldRestarted") == [expected_event]
    assert restarts_metric("Stalled") == before + 1


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_repeated_deaths_back_off_then_exhaust_the_budget(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    # Longer than a new world takes to get its pods back on a loaded machine (the second death
    # must land inside the back-off).
    backoff = 8
    async with running_operator(cluster, fleet.resolve), phase_recorder(cluster) as phases:
        await apply_small_example(
            cluster, tmp_path, maxRestarts=2, backoffSeconds=backoff, maxBackoffSeconds=60
        )
        await wait_for(lambda: ready_after(cluster, 0), START_TIMEOUT, "the world Ready")

        first_worker = uid(cluster, "llama-w0-1")
        await fleet.for_pod("llama-w0-launcher").kill_engine()
        await wait_for(lambda: world(cluster).get("restarts") == 1, 10, "restart 1")
        # The new world fails again at once (a worker pod crashes while the engine still loads):
        # the second restart must wait `backoff` seconds after the first.
        await wait_for(lambda: new_running_pod(cluster, "llama-w0-1", first_worker), 10, "the new worker")
        await sim.fail_pod("llama-w0-1", "rank 1: CUDA error: an illegal memory access", exit_code=134)
        await wait_for(lambda: ready_after(cluster, 2), START_TIMEOUT, "Ready after restart 2")
        pid = await fleet.for_pod("llama-w0-launcher").kill_engine()
        await wait_for(lambda: world(cluster).get("phase") == "Failed", 10, "the world Failed")
        failed_launcher = uid(cluster, "llama-w0-launcher")
        await asyncio.sleep(3)  # three more polls: no restart storm, no restart at all

    current = world(cluster)
    assert current["restarts"] == 2
    history = current["recentRestarts"]  # both restarts, oldest first, each with its own error
    assert [record["reason"] for record in history] == ["EngineDead", "WorkerFailed"]
    assert history[1]["error"].endswith("rank 1: CUDA error: an illegal memory access")
    assert history[-1]["time"] == current["lastRestartTime"] and history[0]["time"] < history[1]["time"]
    assert uid(cluster, "llama-w0-launcher") == failed_launcher
    first, second = (parse_time(t) for t in current["restartTimes"])
    assert (second - first).total_seconds() >= backoff
    assert "BackingOff" in phases, phases
    error = f"WorkerDiedError: the worker process {pid} was killed by signal 9 (SIGKILL)"
    degraded = condition(cluster, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "RestartBudgetExhausted"
    assert error in degraded["message"] and "health.maxRestarts=2" in degraded["message"]
    assert (cluster.get(LLMD, "llama") or {})["status"]["phase"] == "Degraded"
    assert len(warnings(cluster, "WorldRestarted")) == 2
    assert warnings(cluster, "RestartBudgetExhausted") == [f"world 0 gave up after EngineDead: {error}"]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_failed_worker_pod_restarts_the_world(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    async with running_operator(cluster, fleet.resolve):
        await apply_small_example(cluster, tmp_path)
        await wait_for(lambda: ready_after(cluster, 0), START_TIMEOUT, "the world Ready")
        old_launcher = uid(cluster, "llama-w0-launcher")
        await sim.fail_pod("llama-w0-1", "rank 1: NCCL error: unhandled system error", exit_code=134)
        await wait_for(lambda: ready_after(cluster, 1), START_TIMEOUT, "Ready after the worker's failure")

    restarted = world(cluster)
    assert restarted["lastRestartReason"] == "WorkerFailed"
    assert restarted["lastEngineError"] == (
        "worker pod llama-w0-1: container worker exited with code 134 (Error): "
        "rank 1: NCCL error: unhandled system error"
    )
    assert uid(cluster, "llama-w0-launcher") != old_launcher
