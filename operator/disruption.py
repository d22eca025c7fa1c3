"""Worlds and nodes that go away: a lost node (no kubelet answers), and a drained one.

Lost nodes.

A pod's graceful deletion waits for its node's kubelet to confirm that the containers stopped.
On a lost node (NotReady, or gone) no kubelet ever confirms: the pod stays Terminating, and a
launcher (a bare pod with a fixed name) cannot be created again while its old self stands, so
its world would never come back. The operator ends that wait itself: a world's pod that is
terminating on a lost node is deleted with grace period 0 (what `kubectl delete --force` does);
the world is then recreated on nodes that answer. The processes on the lost node, if it still
runs them, are fenced off by the world's new identity (a new launcher, new worker pods).

Nodes are cluster-scoped, so the namespaced install (a Role per namespace) cannot read them.
There a pod still present `OVERDUE_SECONDS` after its deletion deadline (deletionTimestamp: the
request's time plus the pod's grace period, after which a kubelet kills and confirms at once) is
taken to be on a lost node.

Drained nodes. A world is the unit of disruption: its PodDisruptionBudget (render.py) refuses
every eviction of its launcher and worker pods, so a drain (`kubectl drain`, a node upgrade, the
cluster autoscaler) waits on them instead of killing the MPI job one pod at a time. The operator
sees the drain coming by the node (cordoned: `spec.unschedulable`, or one of `DRAIN_TAINTS`) and
moves the world off it as a planned replacement, at most `rollout.maxUnavailable` worlds out of
service at a time (`plan()`, pure): it parks the world (sleep, mode drain: the rollout's path),
then labels the world's pods on the drained nodes `berth.dev/evictable`, which takes them out of
the budget, so the drain's next eviction goes through; once they are gone it replaces the rest of
the world (no restart counted) and the new pods are scheduled on nodes that stay. The next world
is taken once this one is Ready again. If the node is uncordoned first, the world is woken where
it is. If nothing evicts the released pods within `EVICTION_WAIT_SECONDS` (a cordon without a
drain), the operator replaces the world itself: it is parked already, and its node is going.

The operator never deletes a pod on a node being drained itself while a drain may still evict it:
`kubectl drain` retries each pod by name, and a StatefulSet's replacement (same name, another
node) would then be the one evicted, or refused forever.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from berth.operator.kube import Kube, KubeError
from berth.operator.restarts import format_time, parse_time

OVERDUE_SECONDS = 60.0
# Taints that say a node is about to go: kubectl cordon / drain, the cluster autoscaler's
# scale-down, Karpenter's disruption.
DRAIN_TAINTS = (
    "node.kubernetes.io/unschedulable",
    "ToBeDeletedByClusterAutoscaler",
    "karpenter.sh/disrupted",
)
# How long released pods wait for a drain to evict them before the operator moves the world itself.
EVICTION_WAIT_SECONDS = 60.0
# Phases in which the engine answers its admin routes (a park can be asked for).
ANSWERING = ("Ready", "NotReady", "Sleeping", "Waking")


def node_lost(node: Mapping[str, Any] | None) -> bool:
    """The node is gone, or its kubelet stopped reporting (Ready is not True)."""
    if node is None:
        return True
    conditions = (node.get("status") or {}).get("conditions") or []
    return not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def stranded(pods: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Pods being deleted that are bound to a node (the ones only a kubelet would confirm)."""
    return [
        pod
        for pod in pods
        if pod["metadata"].get("deletionTimestamp") and (pod.get("spec") or {}).get("nodeName")
    ]


def overdue(pod: Mapping[str, Any], now: dt.datetime) -> bool:
    """Still there `OVERDUE_SECONDS` past its deletion deadline: no kubelet is confirming it."""
    deadline = parse_time(pod["metadata"]["deletionTimestamp"])
    return (now - deadline).total_seconds() > OVERDUE_SECONDS


def node_draining(node: Mapping[str, Any] | None) -> bool:
    """The node is cordoned or tainted for removal: its pods are about to be evicted."""
    if node is None:
        return False
    spec = node.get("spec") or {}
    return bool(spec.get("unschedulable")) or any(
        taint.get("key") in DRAIN_TAINTS for taint in spec.get("taints") or []
    )


async def read_nodes(kube: Kube, names: Iterable[str]) -> dict[str, Mapping[str, Any] | None] | None:
    """The named Nodes (None for one that is gone); None when this install may not read Nodes
    (the namespaced one)."""
    nodes: dict[str, Mapping[str, Any] | None] = {}
    for name in sorted(set(names)):
        try:
            nodes[name] = await kube.get("v1", "Node", None, name)  # type: ignore[arg-type]
        except KubeError as error:
            if error.status == 403:
                return None
            raise
    return nodes


async def release_from_lost_nodes(
    kube: Kube,
    pods: list[Mapping[str, Any]],
    now: dt.datetime | None = None,
    nodes: Mapping[str, Mapping[str, Any] | None] | None = None,
) -> list[str]:
    """Force-delete (grace 0) the terminating pods whose node is lost; returns their names.
    `nodes`: the Nodes read already this round (else read here, where this install may)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    candidates = stranded(pods)
    if candidates and nodes is None:
        nodes = await read_nodes(kube, (pod["spec"]["nodeName"] for pod in candidates))
    released = []
    for pod in candidates:
        name = pod["spec"]["nodeName"]
        if nodes is not None and name not in nodes:
            nodes = {**nodes, **(await read_nodes(kube, [name]) or {})}
        lost = node_lost(nodes[name]) if nodes is not None else None
        if lost if lost is not None else overdue(pod, now):
            meta = pod["metadata"]
            if await kube.delete("v1", "Pod", meta["namespace"], meta["name"], grace_seconds=0):
                released.append(meta["name"])
    return released


# --- drains --------------------------------------------------------------------------------

Order = Literal["park", "release", "replace", "abort"]


@dataclass(frozen=True)
class WorldOnNodes:
    """One world as the drain planner needs it, this round."""

    index: int
    ready: bool
    phase: str
    admission: str | None
    busy: bool  # a sleep / wakeup of this world is in flight
    nodes: frozenset[str]  # nodes holding a live (not terminating) launcher or worker pod of it
    draining: frozenset[str]  # those of `nodes` being drained
    elsewhere: bool = False  # a rollout or a restart has it already: not the drain's to take
    whole: bool = True  # every pod the world came up on still stands


@dataclass
class DrainPlan:
    orders: list[tuple[int, Order, tuple[str, ...]]] = field(default_factory=list)  # world, order, nodes
    in_flight: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)


def plan(
    worlds: list[WorldOnNodes],
    in_flight: list[Mapping[str, Any]] | None,
    max_unavailable: int,
    now: dt.datetime,
    drain_timeout: float,
) -> DrainPlan:
    """This round's orders for the worlds on drained nodes. `in_flight` (status.disruption) is
    the memory: each world taken, its step (parking, evicting), the nodes it is leaving, since
    when. A world leaves the memory once replaced (or woken where it is)."""
    result = DrainPlan()
    by_index = {world.index: world for world in worlds}
    for entry in in_flight or []:
        world = by_index.get(entry["world"])
        if world is None:
            continue  # scaled away
        index, leaving = world.index, tuple(entry.get("nodes") or ())
        if entry["step"] == "parking":
            if not world.draining:
                result.orders.append((index, "abort", leaving))
                result.events.append(
                    (
                        "Normal",
                        "DrainCancelled",
                        f"world {index}: {_names(leaving)} no longer drained: waking it",
                    )
                )
                continue
            age = (now - parse_time(entry["since"])).total_seconds()
            if world.admission == "parked" or world.phase not in ANSWERING or age > drain_timeout + 30:
                entry = {
                    **entry,
                    "step": "evicting",
                    "nodes": sorted(world.draining),
                    "evictingSince": format_time(now),
                }
                result.orders.append((index, "release", tuple(entry["nodes"])))
                result.events.append(
                    (
                        "Normal",
                        "WorldEvictable",
                        f"world {index} parked: its pods on {_names(entry['nodes'])} may be evicted now",
                    )
                )
            elif world.admission == "running" and not world.busy:
                result.orders.append((index, "park", leaving))
            result.in_flight.append(dict(entry))
            continue
        # evicting: wait for the drain to take the world's pods off the nodes it leaves
        remaining = world.nodes & set(leaving)
        age = (now - parse_time(entry.get("evictingSince") or entry["since"])).total_seconds()
        still_drained = bool(remaining & world.draining)
        if remaining and not still_drained and world.whole:
            result.orders.append((index, "abort", leaving))
            result.events.append(
                ("Normal", "DrainCancelled", f"world {index}: {_names(leaving)} no longer drained: waking it")
            )
            continue
        if not remaining:
            why = "were evicted by the drain"
        elif not still_drained:
            why = "were partly evicted before the drain stopped"
        elif age > EVICTION_WAIT_SECONDS:
            why = f"were not evicted within {EVICTION_WAIT_SECONDS:.0f}s"
        else:
            result.orders.append((index, "release", tuple(sorted(remaining))))
            result.in_flight.append(dict(entry))
            continue
        result.orders.append((index, "replace", leaving))
        result.events.append(
            (
                "Normal",
                "WorldEvicted",
                f"world {index}: its pods on {_names(leaving)} {why}: replacing it on other nodes "
                "(planned: no restart counted)",
            )
        )

    # Worlds out of service count against maxUnavailable, and so does a world taken that still
    # serves (its park has just begun).
    taken = {entry["world"] for entry in result.in_flight}
    unavailable = sum(1 for world in worlds if not world.ready) + sum(
        1 for world in worlds if world.index in taken and world.ready
    )
    handled = taken | {index for index, _, _ in result.orders}  # replaced or woken this round
    waiting = [
        world for world in worlds if world.draining and world.index not in handled and not world.elsewhere
    ]
    # Worlds that serve nothing anyway first: moving them costs no availability.
    for world in sorted(waiting, key=lambda world: (world.ready, world.index)):
        nodes = tuple(sorted(world.draining))
        if world.ready:
            if unavailable >= max_unavailable:
                break
            unavailable += 1
        entry = {"world": world.index, "step": "parking", "nodes": list(nodes), "since": format_time(now)}
        if world.admission == "running" and world.phase in ANSWERING:
            result.orders.append((world.index, "park", nodes))
            message = f"world {world.index}: {_names(nodes)} is being drained: parking the world first"
        else:  # nothing to drain: its pods may go at once
            entry.update(step="evicting", evictingSince=format_time(now))
            result.orders.append((world.index, "release", nodes))
            message = (
                f"world {world.index}: {_names(nodes)} is being drained: its pods may go (it serves nothing)"
            )
        result.in_flight.append(entry)
        result.events.append(("Normal", "NodeDrain", message))
    return result


def _names(nodes: Iterable[str]) -> str:
    nodes = sorted(nodes)
    return ("node " if len(nodes) == 1 else "nodes ") + ", ".join(nodes)
