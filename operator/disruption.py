"""Worlds and lost nodes: a pod being deleted on a node that no longer answers.

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
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from berth.operator.kube import Kube, KubeError
from berth.operator.restarts import parse_time

OVERDUE_SECONDS = 60.0


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


async def _node_lost(kube: Kube, name: str) -> bool | None:
    """Whether the node is lost; None when this install may not read Nodes (namespaced)."""
    try:
        return node_lost(await kube.get("v1", "Node", None, name))  # type: ignore[arg-type]
    except KubeError as error:
        if error.status == 403:
            return None
        raise


async def release_from_lost_nodes(
    kube: Kube, pods: list[Mapping[str, Any]], now: dt.datetime | None = None
) -> list[str]:
    """Force-delete (grace 0) the terminating pods whose node is lost; returns their names."""
    now = now or dt.datetime.now(dt.timezone.utc)
    candidates = stranded(pods)
    nodes: dict[str, bool | None] = {}
    released = []
    for pod in candidates:
        name = pod["spec"]["nodeName"]
        if name not in nodes:
            nodes[name] = await _node_lost(kube, name)
        lost = nodes[name]
        if lost if lost is not None else overdue(pod, now):
            meta = pod["metadata"]
            if await kube.delete("v1", "Pod", meta["namespace"], meta["name"], grace_seconds=0):
                released.append(meta["name"])
    return released
