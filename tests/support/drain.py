"""`kubectl drain` for the test cluster: cordon a node, then evict every pod on it through the
Eviction API (policy/v1), retrying each refused eviction (429: a PodDisruptionBudget allows no
disruption now) until the pod is gone or the time is up, and wait for the pods to be deleted.

As kubectl does: DaemonSet pods are left alone, every other pod is evicted concurrently, each
retried on its own (kubectl every 5 s; here every `retry_seconds`). Each eviction names the
pod's UID as a precondition, so a pod created again under the same name (a StatefulSet's) is
never the one evicted.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from tests.support.cluster import Cluster

UNSCHEDULABLE_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


@dataclass
class Drained:
    """What a drain did: (time.monotonic(), pod) of each eviction that went through, how many
    were refused (429) along the way, and how long it took."""

    evicted: list[tuple[float, str]] = field(default_factory=list)
    refused: int = 0
    seconds: float = 0.0


async def cordon(cluster: Cluster, node: str, unschedulable: bool = True) -> None:
    """`kubectl cordon` (or uncordon): spec.unschedulable and, as the node controller adds it,
    the unschedulable taint."""
    current = cluster.get("v1/nodes", node, None) or {}  # type: ignore[arg-type]
    taints = [
        t for t in (current.get("spec") or {}).get("taints") or [] if t["key"] != UNSCHEDULABLE_TAINT["key"]
    ]
    if unschedulable:
        taints.append(dict(UNSCHEDULABLE_TAINT))
    await cluster.api(
        "PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": unschedulable, "taints": taints}}
    )


async def _evict(cluster: Cluster, pod: dict[str, Any]) -> int:
    meta = pod["metadata"]
    body = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "deleteOptions": {"preconditions": {"uid": meta["uid"]}},
    }
    path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/eviction"
    async with cluster.session.post(cluster.server + path, json=body) as response:
        await response.read()
        return response.status


def _gone(cluster: Cluster, pod: dict[str, Any]) -> bool:
    meta = pod["metadata"]
    now = cluster.get("v1/pods", meta["name"], meta["namespace"])
    return now is None or now["metadata"].get("uid") != meta["uid"]


async def drain(cluster: Cluster, node: str, timeout: float = 60.0, retry_seconds: float = 1.0) -> Drained:
    """Cordon `node` and evict its pods; fails (AssertionError) if they are not all gone in time."""
    started = time.monotonic()
    deadline = started + timeout
    result = Drained()
    await cordon(cluster, node)
    pods = [
        pod
        for pod in cluster.objects("v1/pods", None)
        if pod["spec"].get("nodeName") == node
        and not any(ref.get("kind") == "DaemonSet" for ref in pod["metadata"].get("ownerReferences") or [])
    ]

    async def evict(pod: dict[str, Any]) -> None:
        while True:
            status = await _evict(cluster, pod)
            if status == 201:
                result.evicted.append((time.monotonic(), pod["metadata"]["name"]))
                break
            if status in (404, 409):  # gone, or another pod by now
                break
            if status != 429:
                raise AssertionError(f"evicting {pod['metadata']['name']}: HTTP {status}")
            result.refused += 1
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"drain of {node}: {pod['metadata']['name']} still refused after {timeout}s"
                )
            await asyncio.sleep(retry_seconds)
        while not _gone(cluster, pod):  # evicted: wait for its deletion, as kubectl does
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"drain of {node}: {pod['metadata']['name']} not deleted after {timeout}s"
                )
            await asyncio.sleep(0.1)

    await asyncio.gather(*(evict(pod) for pod in pods))
    result.seconds = time.monotonic() - started
    return result
