"""Worlds on nodes, end to end: the real operator, the test scheduler's nodes
(tests/support/scheduler.py), the test kubelet running the pods the scheduler bound, on their
nodes (tests/support/kubelet.py), and real `berth launch` worlds whose ranks run in the worker
pods over ssh. GPUs are allocatable counts the scheduler fits; the engines run on the CPU
(`--device=cpu`), `gpusPerNode` ranks per worker pod.

The cluster: a CPU node (launchers land there first) and three nodes of 2 GPUs in two racks
(gpu-0 and gpu-2 in r0, gpu-1 in r1).

- topology: a TP-4 world of 2 pods x 2 GPUs with `workers.topologyKey: rack` puts both worker
  pods in one rack (gpu-0 and gpu-2: first fit alone would have taken gpu-1), a TP-2 world with
  `gpusPerNode: 2` is one pod on one node; both serve.
- gang: two deployments that each need 4 of the 6 GPUs. Without a gang scheduler exactly one
  runs and the other is released (Unschedulable, no GPU held, no process left); with
  coscheduling the second's pods stay unbound. Deleting the first brings up the second.
- a drain of the CPU node, which holds the pods of two worlds: one world at a time, each parked
  before its pods are evicted, while the other serves.
- the CPU node lost under a launcher: its processes die, its pod stays Terminating until the
  operator deletes it with grace period 0, and the world is back on a node that answers; each
  step after the one before it, in the order the API server saw them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from berth.operator import naming
from tests.support import e2e
from tests.support.cluster import Cluster, sampling, wait_for
from tests.support.drain import drain
from tests.support.image import Image
from tests.support.kubelet import Kubelet
from tests.support.scheduler import Scheduler, node
from tests.support.steady_client import steady_client
from tests.support.watch_log import Change, watching

NODES = [node("cpu-0"), *(node(f"gpu-{n}", gpus=2, labels={"rack": f"r{n % 2}"}) for n in range(3))]
START_TIMEOUT = 120.0
GANG_TIMEOUT = 3  # spec.scheduling.timeoutSeconds
HEALTH = {**e2e.FAST_HEALTH, "maxBackoffSeconds": 2}
RANK = "berth.engine.executor.worker"


@pytest.fixture
async def scheduler(cluster: Cluster) -> Scheduler:
    scheduler = Scheduler(cluster, NODES)
    await scheduler.create_nodes()
    return scheduler


@pytest.fixture
async def kubelet(
    cluster: Cluster, pod_image: Image, tmp_path: Path, scheduler: Scheduler
) -> AsyncIterator[Kubelet]:
    """The test kubelet under the scheduler: it runs only bound pods, on their nodes."""
    async with e2e.running_kubelet(cluster, pod_image, tmp_path, scheduler) as kubelet:
        yield kubelet


def manifest(models: Path, name: str, tensor_parallel: int, gpus_per_node: int, **spec: Any) -> dict:
    doc = e2e.tiny_cpu_example(
        models,
        tensorParallelSize=tensor_parallel,
        gpusPerNode=gpus_per_node,
        health=HEALTH,
        **spec,
    )
    if gpus_per_node:
        doc["spec"]["engineArgs"] = ["--device=cpu"]  # GPUs to the scheduler, the CPU to the engine
    doc["metadata"]["name"] = name
    return doc


def ready(llmd: e2e.Deployed, index: int = 0) -> bool:
    return llmd.world(index).get("phase") == "Ready"


async def serves(llmd: e2e.Deployed) -> str:
    """Waits for the world Ready and the Service's endpoint, then completes a prompt."""
    await llmd.wait(
        lambda: llmd.world().get("phase") in ("Ready", "Failed"), START_TIMEOUT, f"{llmd.name} Ready"
    )
    assert ready(llmd), llmd.world().get("lastEngineError")
    await llmd.wait(llmd.endpoints, 30, f"a ready endpoint of {llmd.name}")
    return await llmd.complete()


def ranks(kubelet: Kubelet, pod: str) -> int:
    """Engine ranks running in a worker pod (mpirun's, under the pod's sshd)."""
    return sum(1 for pid in kubelet.processes(pod) if RANK in " ".join(psutil.Process(pid).cmdline()))


def pods_running(kubelet: Kubelet, deployment: str) -> list[str]:
    return [runtime.name for runtime in kubelet.pods.values() if runtime.name.startswith(f"{deployment}-w")]


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_worker_pods_share_a_rack_and_a_world_one_node_holds_runs_on_one(
    cluster: Cluster, scheduler: Scheduler, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    racked = manifest(models, "rack", 4, 2, workers={"topologyKey": "rack"})
    async with e2e.deployed(cluster, kubelet, racked, tmp_path, scheduler) as rack:
        await serves(rack)
        pair = await e2e.apply(cluster, kubelet, manifest(models, "pair", 2, 2), tmp_path)
        await serves(pair)
        # gpu-1 (rack r1) had room for the second worker pod: the rack kept it in r0.
        assert rack.nodes() == {"rack-w0-launcher": "cpu-0", "rack-w0-0": "gpu-0", "rack-w0-1": "gpu-2"}
        assert pair.nodes() == {"pair-w0-launcher": "cpu-0", "pair-w0-0": "gpu-1"}
        assert scheduler.gpus_held("default", "rack") == 4 and scheduler.gpus_held("default", "pair") == 2
        # Each pod runs on the node it was bound to, with gpusPerNode ranks per worker pod.
        assert kubelet.runtime("rack-w0-1").node == "gpu-2"
        assert [ranks(kubelet, pod) for pod in ("rack-w0-0", "rack-w0-1", "pair-w0-0")] == [2, 2, 2]
        assert await rack.complete() and await pair.complete()


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_without_a_gang_scheduler_one_of_two_worlds_runs_and_the_other_holds_nothing(
    cluster: Cluster, scheduler: Scheduler, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    gang = {"gang": "none", "timeoutSeconds": GANG_TIMEOUT}
    first = manifest(models, "first", 4, 2, scheduling=gang)
    async with e2e.deployed(cluster, kubelet, first, tmp_path, scheduler) as one:
        two = await e2e.apply(cluster, kubelet, manifest(models, "second", 4, 2, scheduling=gang), tmp_path)
        applied = time.monotonic()

        def released() -> list[e2e.Deployed]:
            return [llmd for llmd in (one, two) if llmd.world().get("scheduling", {}).get("attempts")]

        # Within two scheduling timeouts (a margin for a busy machine) one world is released.
        (waiting,) = await wait_for(released, 2 * GANG_TIMEOUT + 10, "a world released")
        print(f"{waiting.name} released {time.monotonic() - applied:.1f}s after it was applied")
        running = two if waiting is one else one
        await wait_for(lambda: ready(running), START_TIMEOUT, f"{running.name} Ready")
        assert released() == [waiting]

        def holding_nothing() -> dict[str, Any] | None:
            """The released world between two tries: no GPU held, no process of it running (a
            try binds what fits for up to the scheduling timeout, then lets it go again)."""
            world = waiting.world()
            if world.get("phase") != "Unschedulable" or scheduler.gpus_held("default", waiting.name):
                return None
            return None if pods_running(kubelet, waiting.name) else world

        world = await wait_for(holding_nothing, 30, f"{waiting.name} Unschedulable, holding nothing")
        assert "Insufficient nvidia.com/gpu" in world["scheduling"]["message"]
        assert world.get("restarts", 0) == 0  # a release is not a restart
        assert not waiting.executions("launcher")  # its launcher never started
        assert ready(running) and scheduler.gpus_held("default", running.name) == 4
        await serves(running)

        await running.delete()
        assert await serves(waiting)
        assert scheduler.gpus_held("default", waiting.name) == 4
        assert waiting.world().get("restarts", 0) == 0


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_with_coscheduling_the_second_world_stays_unbound_until_the_first_goes(
    cluster: Cluster, scheduler: Scheduler, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    gang = {"gang": "coscheduling", "timeoutSeconds": GANG_TIMEOUT}
    first = manifest(models, "first", 4, 2, scheduling=gang)
    async with e2e.deployed(cluster, kubelet, first, tmp_path, scheduler) as one:
        await serves(one)
        two = await e2e.apply(cluster, kubelet, manifest(models, "second", 4, 2, scheduling=gang), tmp_path)
        await wait_for(
            lambda: "pod group second-w0: 2 of 3 pods fit" in (two.world().get("message") or ""),
            30,
            "the second world waiting for its whole group",
        )
        assert two.nodes() == {} and not pods_running(kubelet, "second") and not two.executions()
        await one.delete()
        assert await serves(two)
        assert set(two.nodes()) == {"second-w0-launcher", "second-w0-0", "second-w0-1"}


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_a_drain_moves_one_parked_world_at_a_time_while_the_other_serves(
    cluster: Cluster, scheduler: Scheduler, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    doc = manifest(models, "duo", 1, 0, replicas=2, rollout={"maxUnavailable": 1, "drainTimeoutSeconds": 10})
    async with e2e.deployed(cluster, kubelet, doc, tmp_path, scheduler) as duo:
        await duo.wait(lambda: ready(duo, 0) and ready(duo, 1), START_TIMEOUT, "both worlds Ready")
        assert set(duo.nodes().values()) == {"cpu-0"}, duo.nodes()

        def launchers() -> list[tuple[int, str]]:
            found = []
            for index in (0, 1):
                ip = duo.pod_status(naming.launcher_pod_name("duo", index)).get("podIP")
                if ip:
                    found.append((index, f"http://{ip}:{naming.ENGINE_PORT}"))
            return found

        samples: list[tuple[float, list[Any], list[Any]]] = []  # (time, phases, admissions)

        def sample() -> None:
            worlds = [duo.world(0), duo.world(1)]
            samples.append(
                (time.monotonic(), [w.get("phase") for w in worlds], [w.get("admission") for w in worlds])
            )

        async with (
            steady_client(launchers, duo.get()["spec"]["model"]["path"]) as tally,
            sampling(sample, 0.1),
        ):
            await wait_for(lambda: len(tally["ok"]) >= 4, 30, "the client served")
            drained = await drain(cluster, "cpu-0", timeout=3 * START_TIMEOUT)
            await duo.wait(lambda: ready(duo, 0) and ready(duo, 1), START_TIMEOUT, "both worlds Ready again")
        print(f"drain done in {drained.seconds:.1f}s; {drained.refused} evictions refused on the way")

        evicted: dict[int, list[float]] = {0: [], 1: []}
        for at, pod in drained.evicted:
            evicted[int(pod.removeprefix("duo-w").split("-")[0])].append(at)
        assert all(len(times) == 2 for times in evicted.values()), drained.evicted  # launcher + worker
        first, second = sorted(evicted, key=lambda index: min(evicted[index]))
        assert max(evicted[first]) < min(evicted[second]), "the two worlds were evicted together"
        for index in (first, second):
            assert any(
                at < min(evicted[index]) and admissions[index] == "parked" for at, _, admissions in samples
            ), f"world {index} was evicted before it was parked"
        assert any(
            max(evicted[first]) < at < min(evicted[second]) and phases[first] == "Ready"
            for at, phases, _ in samples
        ), "the second world was evicted before the first was back"
        # A world served all along: while each was away, the other answered.
        assert tally["failed"] == [] and tally["nothing_ready"] == [], tally
        for index in (first, second):
            away = [
                at for at, phases, _ in samples if phases[index] != "Ready" and at >= min(evicted[first]) - 30
            ]
            assert any(min(away) <= at <= max(away) and served == 1 - index for at, served in tally["ok"])
        assert set(duo.nodes().values()) == {"gpu-0"}, duo.nodes()
        assert [duo.world(index).get("restarts", 0) for index in (0, 1)] == [0, 0]
        assert await serves(duo)


def ready_condition(obj: dict[str, Any]) -> bool:
    """A node's or a pod's Ready condition is True."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def world_status(change: Change) -> dict[str, Any]:
    return next(iter((change.object.get("status") or {}).get("worlds") or []), {})


# How long the operator may take to see a lost launcher: failureThreshold unanswered polls, each
# up to an interval plus its timeout (the bound operator/README.md's "Scheduling" states), and slack.
DETECTION_TIMEOUT = (
    HEALTH.get("failureThreshold", 3) * (HEALTH["intervalSeconds"] + HEALTH["timeoutSeconds"]) + 30
)


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_a_launcher_on_a_lost_node_is_force_deleted_and_its_world_comes_back(
    cluster: Cluster, scheduler: Scheduler, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    """The recovery, step by step, in the order the API server saw it (its resource versions),
    never against a clock: the node NotReady and the launcher marked not Ready (the node
    controller's part); the world's restart written (reason Unreachable), then the launcher
    deleted, then deleted with grace period 0 (its node confirms nothing); a new launcher
    created, bound to a node that answers; the world Ready again."""
    async with e2e.deployed(cluster, kubelet, manifest(models, "solo", 1, 1), tmp_path, scheduler) as solo:
        await serves(solo)
        assert solo.nodes() == {"solo-w0-launcher": "cpu-0", "solo-w0-0": "gpu-0"}
        old = solo.pod("solo-w0-launcher")["metadata"]["uid"]
        processes = kubelet.processes("solo-w0-launcher")
        namespace = cluster.namespace
        watched = (
            "/api/v1/nodes",
            f"/api/v1/namespaces/{namespace}/pods",
            f"/apis/berth.dev/v1alpha1/namespaces/{namespace}/llmdeployments",
        )

        def launcher(change: Change) -> bool:
            return change.resource == "pods" and change.name == "solo-w0-launcher"

        def llmd(change: Change) -> bool:
            return change.resource == "llmdeployments" and change.name == "solo"

        async with watching(cluster, *watched) as log:
            await scheduler.lose("cpu-0")  # the node and its processes are gone; the API says Running
            await wait_for(
                lambda: not any(psutil.pid_exists(pid) for pid in processes), 10, "its processes gone"
            )
            assert old in kubelet.lost  # never reported on, never confirmed deleted again
            lost = await log.wait_first(
                lambda c: c.resource == "nodes" and c.name == "cpu-0" and not ready_condition(c.object),
                10,
                "cpu-0 NotReady",
            )
            marked = await log.wait_first(
                lambda c: launcher(c) and c.uid == old and not ready_condition(c.object),
                10,
                "launcher not Ready",
            )
            restarted = await log.wait_first(
                lambda c: llmd(c) and world_status(c).get("restarts", 0) >= 1,
                DETECTION_TIMEOUT,
                "the world's restart in its status",
            )
            deleting = await log.wait_first(
                lambda c: launcher(c) and c.uid == old and c.object["metadata"].get("deletionTimestamp"),
                DETECTION_TIMEOUT,
                "the old launcher deleted",
            )
            gone = await log.wait_first(
                lambda c: launcher(c) and c.uid == old and c.type == "DELETED", 30, "the old launcher gone"
            )
            created = await log.wait_first(
                lambda c: launcher(c) and c.uid != old and c.type == "ADDED", 60, "a new launcher", after=gone
            )
            bound = await log.wait_first(
                lambda c: launcher(c) and c.uid == created.uid and c.object["spec"].get("nodeName"),
                60,
                "the new launcher bound to a node",
                after=created,
            )
            back = await log.wait_first(
                lambda c: llmd(c) and world_status(c).get("phase") == "Ready",
                30 + START_TIMEOUT,
                "the world Ready again",
                after=restarted,
            )
        steps = {
            "node lost": lost,
            "launcher marked not Ready": marked,
            "restart written": restarted,
            "launcher deleted": deleting,
            "new launcher created": created,
            "new launcher bound": bound,
            "world Ready": back,
        }
        print("; ".join(f"{what} +{change.at - lost.at:.1f}s" for what, change in steps.items()))
        versions = [change.resource_version for change in steps.values()]
        assert versions == sorted(versions) and len(set(versions)) == len(versions), steps
        assert deleting.seq < gone.seq < created.seq  # one watch (pods): the order it streamed
        assert gone.object["metadata"]["deletionTimestamp"]  # deleted gracefully first, then forced
        assert bound.object["spec"]["nodeName"] == "gpu-0"  # not the lost node
        assert world_status(restarted)["lastRestartReason"] == "Unreachable"
        assert world_status(restarted).get("phase") != "Ready"
        assert world_status(back)["restarts"] == 1
        assert any(
            "solo-w0-launcher" in m and "grace period 0" in m for m in cluster.event_messages("PodOnLostNode")
        )
        assert solo.nodes()["solo-w0-launcher"] == "gpu-0"
        assert await serves(solo)
