"""Worlds and lost nodes: a pod being deleted on a node that no longer answers.

A pod's graceful deletion waits for its node's kubelet to confirm that the containers stopped.
On a lost node (NotReady, or gone) no kubelet ever confirms: the pod stays Terminating, and a
launcher (a bare pod with a fixed name) cannot be created again while its old self stands, so
its world would never come back. The operator ends that wait itself: a world's pod that is
terminating on a lost node is deleted with grace period 0 (what `kubectl delete --force` does);
the world is then recreated on nodes that answer. The processes on the lost node, if it still
runs them, are fenced off by the world's new identity (a new launcher, new worker pods).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from berth.operator.kube import Kube


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


async def release_from_lost_nodes(kube: Kube, pods: list[Mapping[str, Any]]) -> list[str]:
    """Force-delete (grace 0) the terminating pods whose node is lost; returns their names."""
    candidates = stranded(pods)
    nodes: dict[str, bool] = {}
    released = []
    for pod in candidates:
        name = pod["spec"]["nodeName"]
        if name not in nodes:
            nodes[name] = node_lost(await kube.get("v1", "Node", None, name))  # type: ignore[arg-type]
        if nodes[name]:
            meta = pod["metadata"]
            if await kube.delete("v1", "Pod", meta["namespace"], meta["name"], grace_seconds=0):
                released.append(meta["name"])
    return released
