"""A node drain moves worlds, not pods: the real operator, the test scheduler's nodes, a real
`berth serve` behind every launcher pod, and a drain through the Eviction API
(tests/support/drain.py) that the emulator answers as an API server does, PodDisruptionBudgets
included.

Two worlds of one deployment (rollout.maxUnavailable 1) run on node-a; node-b is spare. Draining
node-a while a client sends requests to whichever world is ready: every eviction is refused until
the operator has parked a world (sleep, mode drain) and released its pods; one world's pods are
evicted, it comes back on node-b, and only then is the other world parked and evicted. A world
always serves, no request fails, no restart is counted, and the drain finishes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cluster import Cluster, ClusterSim, sampling, wait_for
from tests.support.drain import cordon, drain
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.kube_emulator import disruptions_allowed
from tests.support.operator_runner import running_operator
from tests.support.scheduler import Scheduler, node
from tests.support.steady_client import steady_client

LLMD = "berth.dev/v1alpha1/llmdeployments"
NAME = "duo"
LAUNCHERS = [f"{NAME}-w0-launcher", f"{NAME}-w1-launcher"]


def manifest() -> dict[str, Any]:
    return {
        "apiVersion": "berth.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"path": "/models/tiny"},
            "image": "berth:test",
            "replicas": 2,
            "gpusPerNode": 0,
            "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 20},
            "health": {"intervalSeconds": 1, "timeoutSeconds": 1, "backoffSeconds": 1},
        },
    }


@pytest.fixture
async def nodes(cluster: Cluster, fleet: EngineFleet) -> AsyncIterator[Scheduler]:
    """Two nodes (the scheduler fills node-a first), the controllers and a kubelet that runs
    bound pods."""
    scheduler = Scheduler(cluster, [node("node-a"), node("node-b")])
    await scheduler.create_nodes()
    fleet.read_secret = lambda namespace, name: cluster.get("v1/secrets", name, namespace)
    sim = ClusterSim(
        cluster, on_pod_start=fleet.on_pod_start, on_pod_stop=fleet.on_pod_stop, scheduler=scheduler
    )
    async with sim.running():
        yield scheduler


@pytest.fixture
async def scheduled(cluster: Cluster, nodes: Scheduler, fleet: EngineFleet) -> AsyncIterator[Scheduler]:
    """The nodes and the operator."""
    async with running_operator(cluster, fleet.resolve):
        yield nodes


def worlds(cluster: Cluster) -> list[dict[str, Any]]:
    return ((cluster.get(LLMD, NAME) or {}).get("status") or {}).get("worlds") or []


def placed(cluster: Cluster) -> dict[str, str]:
    """Pod -> node of the deployment's launcher and worker pods that are bound and not going."""
    return {
        pod["metadata"]["name"]: pod["spec"]["nodeName"]
        for pod in cluster.objects("v1/pods")
        if (pod["metadata"].get("labels") or {}).get("berth.dev/deployment") == NAME
        and pod["spec"].get("nodeName")
        and not pod["metadata"].get("deletionTimestamp")
    }


def world_of(pod: str) -> int:
    return int(pod.removeprefix(f"{NAME}-w").split("-")[0])


def launchers(fleet: EngineFleet) -> list[tuple[int, str]]:
    """(world, server URL) of each launcher pod that has a server now."""
    found = []
    for index, name in enumerate(LAUNCHERS):
        with contextlib.suppress(AssertionError):
            found.append((index, fleet.for_pod(name).url))
    return found


def pod(name: str, ready: bool = True, app: str = "x", **meta: Any) -> dict[str, Any]:
    status = "True" if ready else "False"
    return {
        "metadata": {"name": name, "namespace": "default", "labels": {"app": app}, **meta},
        "spec": {"nodeName": "node-a"},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": status}]},
    }


def budget(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "b"}, "spec": {"selector": {"matchLabels": {"app": "x"}}, **spec}}


def test_the_emulator_counts_disruptions_as_the_disruption_controller_does() -> None:
    pods = [pod("p0"), pod("p1"), pod("p2"), pod("other", app="y")]
    assert disruptions_allowed(budget(maxUnavailable=0), pods) == 0
    assert disruptions_allowed(budget(maxUnavailable=1), pods) == 1
    assert disruptions_allowed(budget(maxUnavailable="50%"), pods) == 2  # 1.5 pods, rounded up
    assert disruptions_allowed(budget(minAvailable=2), pods) == 1
    assert disruptions_allowed(budget(minAvailable="100%"), pods) == 0
    # An unhealthy pod (not Ready, or terminating) uses up the budget.
    hurt = [pod("p0", ready=False), pod("p1"), pod("p2", deletionTimestamp="2026-12-05T12:00:00Z")]
    assert disruptions_allowed(budget(maxUnavailable=1), hurt) == 0
    assert disruptions_allowed(budget(minAvailable=1), hurt) == 0


async def test_the_emulator_evicts_through_budgets_as_an_api_server_does(cluster: Cluster) -> None:
    for name in ("p0", "p1"):
        created = await cluster.api("POST", "/api/v1/namespaces/default/pods", {**pod(name), "kind": "Pod"})
        await cluster.api(
            "PATCH", f"/api/v1/namespaces/default/pods/{name}/status", {"status": pod(name)["status"]}
        )
    await cluster.api(
        "POST",
        "/apis/policy/v1/namespaces/default/poddisruptionbudgets",
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", **budget(maxUnavailable=1)},
    )

    async def evict(name: str, uid: str | None = None) -> int:
        body: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name}}
        if uid:
            body["deleteOptions"] = {"preconditions": {"uid": uid}}
        url = f"{cluster.server}/api/v1/namespaces/default/pods/{name}/eviction"
        async with cluster.session.post(url, json=body) as response:
            return response.status

    assert await evict("p0", uid="another-pod") == 409
    assert await evict("p0") == 201  # one of two may go: deleted gracefully (it is bound to a node)
    assert cluster.get("v1/pods", "p0")["metadata"]["deletionTimestamp"]
    assert await evict("p1") == 429  # p0 terminating: the budget is spent
    assert await evict("missing") == 404
    assert created["metadata"]["name"] == "p1"


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_drain_evicts_one_parked_world_at_a_time_while_the_other_serves(
    cluster: Cluster, scheduled: Scheduler, fleet: EngineFleet, tmp_path: Path
) -> None:
    (tmp_path / "duo.yaml").write_text(yaml.safe_dump(manifest()))
    await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "duo.yaml"))
    await wait_for(
        lambda: [world.get("phase") for world in worlds(cluster)] == ["Ready", "Ready"],
        START_TIMEOUT,
        "both worlds Ready",
    )
    assert set(placed(cluster).values()) == {"node-a"}, placed(cluster)
    budgets = cluster.objects("policy/v1/poddisruptionbudgets")
    assert [budget["metadata"]["name"] for budget in budgets] == [f"{NAME}-w0", f"{NAME}-w1"]
    assert all(budget["spec"]["maxUnavailable"] == 0 for budget in budgets)

    samples: list[tuple[float, list[str | None], list[str | None]]] = []  # (time, phases, admissions)

    def sample() -> None:
        now = worlds(cluster)
        samples.append((time.monotonic(), [w.get("phase") for w in now], [w.get("admission") for w in now]))

    async with steady_client(lambda: launchers(fleet), str(fleet.model)) as tally, sampling(sample, 0.1):
        await wait_for(lambda: len(tally["ok"]) >= 4, 30, "the client served")
        drained = await drain(cluster, "node-a", timeout=3 * START_TIMEOUT)
        await wait_for(
            lambda: [world.get("phase") for world in worlds(cluster)] == ["Ready", "Ready"],
            START_TIMEOUT,
            "both worlds Ready again",
        )
    print(f"drain done in {drained.seconds:.1f}s; {drained.refused} evictions refused on the way")

    # Every eviction was refused until the operator released a parked world; then one world's
    # pods went, and the other's only once the first was Ready again on node-b.
    assert drained.refused > 0
    evicted: dict[int, list[float]] = {0: [], 1: []}
    for at, pod in drained.evicted:
        evicted[world_of(pod)].append(at)
    assert all(len(times) == 2 for times in evicted.values()), drained.evicted  # launcher + worker
    first, second = sorted(evicted, key=lambda index: min(evicted[index]))
    assert max(evicted[first]) < min(evicted[second])
    assert any(
        max(evicted[first]) < at < min(evicted[second]) and phases[first] == "Ready"
        for at, phases, _ in samples
    ), "the second world was evicted before the first was back"
    for index in (first, second):
        # Parked (the engine drained and closed admission) before any of its pods was evicted.
        assert any(
            at < min(evicted[index]) and admissions[index] == "parked" for at, _, admissions in samples
        )
    # A world served all along: requests completed on the other world while each was away.
    assert tally["failed"] == [] and tally["nothing_ready"] == []
    for index in (first, second):
        other = 1 - index
        away = [at for at, phases, _ in samples if phases[index] != "Ready" and at > min(evicted[first]) - 30]
        assert any(min(away) <= at <= max(away) and served == other for at, served in tally["ok"])

    # Both back on node-b, as planned replacements: no restart counted, the Events say why.
    assert set(placed(cluster).values()) == {"node-b"}, placed(cluster)
    assert [world.get("restarts", 0) for world in worlds(cluster)] == [0, 0]
    assert len(cluster.event_messages("WorldEvicted")) == 2
    assert any("parking the world first" in message for message in cluster.event_messages("NodeDrain"))
    assert "disruption" not in (cluster.get(LLMD, NAME) or {}).get("status", {})
    # The evicted pods' replacements are protected again: no pod carries the release label.
    assert not [
        pod["metadata"]["name"]
        for pod in cluster.objects("v1/pods")
        if "berth.dev/evictable" in (pod["metadata"].get("labels") or {})
    ]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_world_on_a_cordoned_node_that_is_uncordoned_is_woken_where_it_is(
    cluster: Cluster, scheduled: Scheduler, fleet: EngineFleet, tmp_path: Path
) -> None:
    doc = manifest()
    doc["spec"]["replicas"] = 1
    (tmp_path / "solo.yaml").write_text(yaml.safe_dump(doc))
    await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "solo.yaml"))
    await wait_for(lambda: [w.get("phase") for w in worlds(cluster)] == ["Ready"], START_TIMEOUT, "Ready")
    before = dict(placed(cluster))
    await cordon(cluster, "node-a")  # no drain follows
    await wait_for(lambda: worlds(cluster)[0].get("admission") == "parked", 30, "the world parked")
    await cordon(cluster, "node-a", unschedulable=False)
    await wait_for(lambda: worlds(cluster)[0].get("phase") == "Ready", 30, "the world awake again")
    assert placed(cluster) == before  # the same pods, never evicted
    assert cluster.event_messages("DrainCancelled")
    assert worlds(cluster)[0].get("restarts", 0) == 0
    assert not [
        pod["metadata"]["name"]
        for pod in cluster.objects("v1/pods")
        if "berth.dev/evictable" in (pod["metadata"].get("labels") or {})
    ]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_an_operator_restarted_mid_drain_resumes_from_status_without_counting_a_restart(
    cluster: Cluster, nodes: Scheduler, fleet: EngineFleet, tmp_path: Path
) -> None:
    doc = manifest()
    doc["spec"]["replicas"] = 1
    (tmp_path / "solo.yaml").write_text(yaml.safe_dump(doc))

    def step() -> str | None:
        memory = ((cluster.get(LLMD, NAME) or {}).get("status") or {}).get("disruption") or {}
        return ((memory.get("inFlight") or [{}])[0]).get("step")

    async with running_operator(cluster, fleet.resolve):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "solo.yaml"))
        await wait_for(lambda: [w.get("phase") for w in worlds(cluster)] == ["Ready"], START_TIMEOUT, "Ready")
        await cordon(cluster, "node-a")
        await wait_for(lambda: step() == "evicting", 30, "the world parked and released to the drain")
    # The operator is gone; the drain evicts the released pods meanwhile.
    drained = await drain(cluster, "node-a", timeout=10)
    assert sorted(pod for _, pod in drained.evicted) == [f"{NAME}-w0-0", f"{NAME}-w0-launcher"]
    async with running_operator(cluster, fleet.resolve):
        await wait_for(
            lambda: [w.get("phase") for w in worlds(cluster)] == ["Ready"] and step() is None,
            START_TIMEOUT,
            "the world back, replaced by the new operator",
        )
    assert set(placed(cluster).values()) == {"node-b"}
    assert worlds(cluster)[0].get("restarts", 0) == 0
    assert len(cluster.event_messages("WorldEvicted")) == 1
