"""Gang membership, berth's own release decision and the workers' packing and topology, without a
cluster: operator/gang.py is pure, and the rendered worker pods are placed by the test scheduler's
filters (tests/support/scheduler.py) on nodes that say what they hold."""

from __future__ import annotations

import datetime as dt
from typing import Any

from berth.operator import gang, render
from berth.operator.crd_model import parse_spec
from berth.operator.restarts import format_time, parse_time
from tests.support.scheduler import Placement, node

OWNER = render.Owner(name="llama", namespace="ml", uid="1234-uid")
T0 = dt.datetime(2026, 12, 5, 9, 0, tzinfo=dt.timezone.utc)


def spec(**changes: Any):
    raw = {"model": {"path": "/m"}, "image": "berth:1", "tensorParallelSize": 4, "gpusPerNode": 2, **changes}
    return parse_spec(raw)


def world_pods(parsed, world: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    children = {child["kind"]: child for child in render.world_children(OWNER, parsed, world)}
    sts = children["StatefulSet"]
    workers = [
        {
            "metadata": {
                "name": f"{sts['metadata']['name']}-{n}",
                "namespace": "ml",
                "labels": sts["spec"]["template"]["metadata"]["labels"],
                "annotations": sts["spec"]["template"]["metadata"].get("annotations", {}),
            },
            "spec": sts["spec"]["template"]["spec"],
        }
        for n in range(sts["spec"]["replicas"])
    ]
    return children["Pod"], workers


def test_each_gang_schedulers_membership() -> None:
    co = spec(scheduling={"gang": "coscheduling", "timeoutSeconds": 120})
    group = render.pod_group(OWNER, co, 0)
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1" and group["kind"] == "PodGroup"
    assert (
        group["metadata"]["name"] == "llama-w0"
        and group["metadata"]["ownerReferences"][0]["uid"] == "1234-uid"
    )
    assert group["spec"] == {"minMember": 3, "scheduleTimeoutSeconds": 120}  # launcher + 2 worker pods
    launcher, workers = world_pods(co)
    assert launcher["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "llama-w0"
    assert all(w["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "llama-w0" for w in workers)

    volcano = spec(scheduling={"gang": "volcano", "queueName": "gpus"})
    assert render.pod_group(OWNER, volcano, 1)["spec"] == {"minMember": 3, "queue": "gpus"}
    assert render.pod_group(OWNER, volcano, 1)["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    launcher, workers = world_pods(volcano, 1)
    assert launcher["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "llama-w1"
    assert workers[0]["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "llama-w1"

    kueue = spec(scheduling={"gang": "kueue", "queueName": "team-a"})
    assert render.pod_group(OWNER, kueue, 0) is None  # Kueue groups pods by their labels
    launcher, workers = world_pods(kueue)
    for pod in (launcher, *workers):
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "llama-w0"
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"

    plain = spec()
    assert render.pod_group(OWNER, plain, 0) is None
    assert not any(
        "scheduling" in key or "kueue" in key for key in world_pods(plain)[0]["metadata"]["labels"]
    )


def pending(name: str, message: str) -> dict[str, Any]:
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    return {"metadata": {"name": name}, "spec": {}, "status": {"phase": "Pending", "conditions": [condition]}}


BOUND = {"metadata": {"name": "llama-w0-0"}, "spec": {"nodeName": "gpu-0"}, "status": {"phase": "Running"}}
NO_ROOM = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


def test_a_world_not_scheduled_whole_within_the_timeout_is_released_then_retried() -> None:
    parsed = spec(scheduling={"timeoutSeconds": 60}, health={"backoffSeconds": 10, "maxBackoffSeconds": 300})
    workers = [BOUND, pending("llama-w0-1", NO_ROOM)]
    waiting = {"index": 0, "phase": "Pending", "message": "worker pods not running yet"}
    first = gang.judge(waiting, {}, None, workers, parsed, "llama", 0, T0)
    assert first.order is None and first.status["phase"] == "Pending"
    assert first.status["scheduling"]["waitingSince"] == format_time(T0)
    assert NO_ROOM in first.status["message"] and "llama-w0-1" in first.status["message"]
    # Still waiting just before the timeout; released at it.
    almost = gang.judge(
        waiting, first.status, None, workers, parsed, "llama", 0, T0 + dt.timedelta(seconds=59)
    )
    assert almost.order is None
    released = gang.judge(
        waiting, first.status, None, workers, parsed, "llama", 0, T0 + dt.timedelta(seconds=60)
    )
    assert released.order == "release" and released.status["phase"] == "Unschedulable"
    memory = released.status["scheduling"]
    assert memory["attempts"] == 1 and NO_ROOM in memory["message"]
    delay = (parse_time(memory["retryAt"]) - (T0 + dt.timedelta(seconds=60))).total_seconds()
    assert 10 <= delay <= 15  # backoffSeconds plus up to half of it as jitter
    assert released.event[1] == "WorldUnschedulable"
    # While released: no pods (the reconcile renders none), Unschedulable, nothing ordered.
    later = T0 + dt.timedelta(seconds=65)
    assert gang.released_worlds([released.status], later) == {0}
    held = gang.judge({"index": 0, "phase": "Pending"}, released.status, None, [], parsed, "llama", 0, later)
    assert held.order is None and held.status["phase"] == "Unschedulable"
    # At the retry time the world comes back, and the next release backs off longer.
    retry = parse_time(memory["retryAt"])
    assert gang.released_worlds([released.status], retry) == frozenset()
    resumed = gang.judge(
        {"index": 0, "phase": "Pending"}, released.status, None, [], parsed, "llama", 0, retry
    )
    assert resumed.order == "resume" and resumed.status["scheduling"]["attempts"] == 1
    assert 20 <= gang.retry_delay(parsed, "llama", 0, 2) <= 30
    assert gang.retry_delay(parsed, "llama", 0, 9) <= 450  # capped at maxBackoffSeconds (+ jitter)


def test_jitter_sets_two_competing_deployments_apart() -> None:
    parsed = spec()
    delays = {gang.retry_delay(parsed, name, 0, 1) for name in ("alpha", "beta", "gamma", "delta")}
    assert len(delays) == 4


def test_only_berth_releases_and_only_without_a_gang_scheduler() -> None:
    parsed = spec(scheduling={"gang": "coscheduling", "timeoutSeconds": 1})
    workers = [pending("llama-w0-0", NO_ROOM), pending("llama-w0-1", NO_ROOM)]
    first = gang.judge({"phase": "Pending"}, {}, None, workers, parsed, "llama", 0, T0)
    later = gang.judge(
        {"phase": "Pending"}, first.status, None, workers, parsed, "llama", 0, T0 + dt.timedelta(hours=1)
    )
    assert later.order is None and later.status["phase"] == "Pending" and NO_ROOM in later.status["message"]
    # A world that runs forgets it ever waited.
    running = gang.judge({"phase": "Ready"}, later.status, None, [BOUND], parsed, "llama", 0, T0)
    assert "scheduling" not in running.status


def test_the_launcher_starts_once_its_workers_have_nodes() -> None:
    assert not gang.launcher_may_start(spec(), 0, [BOUND])  # one of two worker pods exists
    assert not gang.launcher_may_start(spec(), 0, [BOUND, pending("llama-w0-1", NO_ROOM)])
    assert gang.launcher_may_start(spec(), 0, [BOUND, {**BOUND, "metadata": {"name": "llama-w0-1"}}])
    # A gang scheduler needs the launcher in its group at once.
    assert gang.launcher_may_start(spec(scheduling={"gang": "coscheduling"}), 0, [])


GPU_NODES = {
    name: node(name, gpus=2, labels={"rack": rack})
    for name, rack in (("gpu-0", "r0"), ("gpu-1", "r1"), ("gpu-2", "r0"), ("gpu-3", "r1"))
}


def place(
    parsed, world: int = 0, placement: Placement | None = None
) -> tuple[Placement, dict[str, str | None]]:
    placement = placement or Placement(dict(GPU_NODES))
    _, workers = world_pods(parsed, world)
    return placement, {pod["metadata"]["name"]: placement.place(pod)[0] for pod in workers}


def test_a_small_world_fits_one_node_when_one_node_has_the_gpus() -> None:
    # TP 2, one GPU per pod: both pods on one 2-GPU node (no hard one-pod-per-node rule).
    _, nodes = place(spec(tensorParallelSize=2, gpusPerNode=1))
    assert set(nodes.values()) == {"gpu-0"}
    # TP 2 with gpusPerNode 2: one pod holding both ranks.
    _, nodes = place(spec(tensorParallelSize=2, gpusPerNode=2))
    assert list(nodes.values()) == ["gpu-0"]


def test_a_topology_key_keeps_a_worlds_pods_in_one_domain() -> None:
    # Without it the scheduler takes the first nodes with room: two racks.
    _, nodes = place(spec())
    assert [GPU_NODES[n]["metadata"]["labels"]["rack"] for n in nodes.values()] == ["r0", "r1"]
    placement, nodes = place(spec(workers={"topologyKey": "rack"}))
    assert sorted(nodes.values()) == ["gpu-0", "gpu-2"]  # both in rack r0
    # The next world's pods must share a rack too: r0 is full, so both go to r1.
    _, second = place(spec(workers={"topologyKey": "rack"}), 1, placement)
    assert sorted(second.values()) == ["gpu-1", "gpu-3"]
    # Where no rack has room for the whole world, no pod of it is placed in a wrong one.
    crowded = Placement({name: GPU_NODES[name] for name in ("gpu-0", "gpu-1")})
    _, nodes = place(spec(workers={"topologyKey": "rack"}), 0, crowded)
    assert list(nodes.values()) == ["gpu-0", None]
