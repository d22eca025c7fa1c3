"""Gang scheduling against nodes and a scheduler (tests/support/scheduler.py): two deployments that
each need 4 GPUs on a cluster of 6 (3 nodes x 2) plus a CPU node, the real operator, and a real
`berth serve` behind every launcher pod that runs (tests/support/engine_endpoint.py).

- berth's own all-or-nothing (gang none): within two scheduling timeouts one world runs, the
  other is Unschedulable with the scheduler's message and holds no GPU, its restart budget
  untouched; once the first is deleted, the second comes up.
- coscheduling: a PodGroup per world (minMember = launcher + workers); the scheduler binds a
  group whole or not at all, so the second deployment's pods stay unbound (nothing held).
- a lost node under a launcher: its pod, stuck Terminating (no kubelet confirms), is deleted
  with grace period 0 and the world comes back on the other CPU node.
- templates on nodes: GPU nodes tainted, the workers' template tolerates the taint and selects
  GPU nodes; launchers (no GPU selection any more) land on the CPU node.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from berth.operator.restarts import parse_time
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.operator_runner import running_operator
from tests.support.scheduler import Scheduler, node

LLMD = "berth.dev/v1alpha1/llmdeployments"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
NODES = [
    node("cpu-0"),
    node("cpu-1"),
    *(
        node(f"gpu-{n}", gpus=2, labels={"gpu": "yes", "rack": f"r{n % 2}"}, taints=[GPU_TAINT])
        for n in range(3)
    ),
]
TIMEOUT = 3  # spec.scheduling.timeoutSeconds
WORKERS_ON_GPU_NODES = {
    "template": {
        "spec": {
            "nodeSelector": {"gpu": "yes"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        }
    }
}


def manifest(name: str, gang: str) -> dict[str, Any]:
    """A world of 2 worker pods x 2 GPUs (tensor parallel 4) and a CPU launcher."""
    return {
        "apiVersion": "berth.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": "/models/tiny"},
            "image": "berth:test",
            "tensorParallelSize": 4,
            "gpusPerNode": 2,
            "workers": WORKERS_ON_GPU_NODES,
            "scheduling": {"gang": gang, "timeoutSeconds": TIMEOUT},
            "health": {
                "intervalSeconds": 1,
                "timeoutSeconds": 1,
                "backoffSeconds": 1,
                "maxBackoffSeconds": 2,
            },
        },
    }


@pytest.fixture
async def scheduled(cluster: Cluster, fleet: EngineFleet) -> AsyncIterator[Scheduler]:
    """Nodes, the scheduler, the controllers, a kubelet that runs bound pods, and the operator."""
    scheduler = Scheduler(cluster, NODES)
    await scheduler.create_nodes()
    fleet.read_secret = lambda namespace, name: cluster.get("v1/secrets", name, namespace)
    sim = ClusterSim(
        cluster, on_pod_start=fleet.on_pod_start, on_pod_stop=fleet.on_pod_stop, scheduler=scheduler
    )
    async with sim.running(), running_operator(cluster, fleet.resolve):
        yield scheduler


async def apply(cluster: Cluster, tmp_path: Path, *docs: dict[str, Any]) -> None:
    path = tmp_path / "gang.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    await cluster.kubectl("apply", "--validate=false", "-f", str(path))


async def deploy_ready(cluster: Cluster, tmp_path: Path, name: str, gang: str) -> None:
    await apply(cluster, tmp_path, manifest(name, gang))
    await wait_for(lambda: world(cluster, name).get("phase") == "Ready", START_TIMEOUT, f"{name} Ready")


def world(cluster: Cluster, name: str) -> dict[str, Any]:
    status = (cluster.get(LLMD, name) or {}).get("status") or {}
    return (status.get("worlds") or [{}])[0]


def bound(cluster: Cluster, name: str) -> dict[str, str]:
    """Pod -> node of one deployment's pods that are bound and not going away."""
    return {
        pod["metadata"]["name"]: pod["spec"]["nodeName"]
        for pod in cluster.objects("v1/pods")
        if (pod["metadata"].get("labels") or {}).get("berth.dev/deployment") == name
        and pod["spec"].get("nodeName")
        and not pod["metadata"].get("deletionTimestamp")
    }


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_without_a_gang_scheduler_berth_releases_the_world_that_does_not_fit_whole(
    cluster: Cluster, scheduled: Scheduler, tmp_path: Path
) -> None:
    await apply(cluster, tmp_path, manifest("first", "none"), manifest("second", "none"))
    # Within two scheduling timeouts (plus an engine start): exactly one world runs, the other
    # was released: Unschedulable, in the scheduler's words, holding no GPU.
    ready = lambda name: world(cluster, name).get("phase") == "Ready"  # noqa: E731
    await wait_for(lambda: ready("first") or ready("second"), 2 * TIMEOUT + START_TIMEOUT, "one world Ready")
    running, waiting = ("first", "second") if ready("first") else ("second", "first")
    await wait_for(
        lambda: world(cluster, waiting).get("scheduling", {}).get("attempts"), 2 * TIMEOUT + 10, "a release"
    )
    await wait_for(lambda: scheduled.gpus_held("default", waiting) == 0, 10, "the released world's GPUs back")
    released = world(cluster, waiting)
    assert released["phase"] in ("Unschedulable", "Pending")
    assert "0/5 nodes are available:" in released["scheduling"]["message"]
    assert "Insufficient nvidia.com/gpu" in released["scheduling"]["message"]
    assert released.get("restarts", 0) == 0  # a release is not a restart
    events = [e["message"] for e in cluster.objects("v1/events") if e.get("reason") == "WorldUnschedulable"]
    assert any(
        f"{waiting}" in e["involvedObject"]["name"]
        for e in cluster.objects("v1/events")
        if e.get("reason") == "WorldUnschedulable"
    )
    assert any("not all 3 pods of world 0 were scheduled within 3s" in message for message in events)
    assert ready(running) and scheduled.gpus_held("default", running) == 4
    # The launcher started only once its workers had nodes, on the CPU node (no GPU selection),
    # the workers on GPU nodes (their template's selector and toleration).
    placed = bound(cluster, running)
    assert placed[f"{running}-w0-launcher"] == "cpu-0"
    assert {placed[f"{running}-w0-0"], placed[f"{running}-w0-1"]} <= {"gpu-0", "gpu-1", "gpu-2"}
    history = scheduled.history
    launcher_asked = history.index(("pending", f"{running}-w0-launcher"))
    assert launcher_asked > history.index(("bound", f"{running}-w0-0"))
    assert launcher_asked > history.index(("bound", f"{running}-w0-1"))

    # Retries back off with jitter; once the running deployment goes, the other comes up.
    retry = parse_time(world(cluster, waiting)["scheduling"]["retryAt"])
    await cluster.kubectl("delete", "llmd", running, "--timeout=60s", timeout=90)
    await wait_for(lambda: ready(waiting), 30 + START_TIMEOUT, f"{waiting} Ready once {running} is gone")
    assert world(cluster, waiting).get("restarts", 0) == 0
    assert "scheduling" not in world(cluster, waiting) or not world(cluster, waiting)["scheduling"].get(
        "retryAt"
    )
    assert retry is not None and scheduled.gpus_held("default", waiting) == 4


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_with_coscheduling_the_second_world_holds_nothing_until_the_first_goes(
    cluster: Cluster, scheduled: Scheduler, tmp_path: Path
) -> None:
    await deploy_ready(cluster, tmp_path, "first", "coscheduling")
    group = cluster.get("scheduling.x-k8s.io/v1alpha1/podgroups", "first-w0")
    assert group is not None and group["spec"]["minMember"] == 3
    pod = cluster.get("v1/pods", "first-w0-launcher") or {}
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "first-w0"
    await apply(cluster, tmp_path, manifest("second", "coscheduling"))
    # Its three pods exist and wait, none bound (one worker would fit: the group does not).
    await wait_for(
        lambda: "pod group second-w0: 2 of 3 pods fit" in (world(cluster, "second").get("message") or ""),
        30,
        "the second world waiting for its group",
    )
    assert bound(cluster, "second") == {} and scheduled.gpus_held("default", "second") == 0
    assert world(cluster, "second")["phase"] == "Pending" and world(cluster, "first")["phase"] == "Ready"
    await cluster.kubectl("delete", "llmd", "first", "--timeout=60s", timeout=90)
    await wait_for(
        lambda: world(cluster, "second").get("phase") == "Ready", 30 + START_TIMEOUT, "second Ready"
    )
    assert set(bound(cluster, "second")) == {"second-w0-launcher", "second-w0-0", "second-w0-1"}


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_launcher_on_a_lost_node_is_force_deleted_and_its_world_comes_back(
    cluster: Cluster, scheduled: Scheduler, tmp_path: Path
) -> None:
    await deploy_ready(cluster, tmp_path, "solo", "none")
    launcher = cluster.get("v1/pods", "solo-w0-launcher")
    old_uid, lost = launcher["metadata"]["uid"], launcher["spec"]["nodeName"]
    started = time.monotonic()
    await scheduled.lose(lost)  # the node and its processes are gone; the API still says Running

    def back() -> bool:
        pod = cluster.get("v1/pods", "solo-w0-launcher") or {"metadata": {}, "spec": {}}
        return (
            pod["metadata"].get("uid") not in (None, old_uid)
            and world(cluster, "solo").get("phase") == "Ready"
        )

    await wait_for(back, 30 + START_TIMEOUT, "the world back on another node")
    print(f"world back {time.monotonic() - started:.1f}s after its launcher's node was lost")
    assert cluster.get("v1/pods", "solo-w0-launcher")["spec"]["nodeName"] not in (lost, None)
    events = [e for e in cluster.objects("v1/events") if e.get("reason") == "PodOnLostNode"]
    assert any("solo-w0-launcher" in e["message"] and "grace period 0" in e["message"] for e in events)
    assert world(cluster, "solo")["lastRestartReason"] == "Unreachable"
