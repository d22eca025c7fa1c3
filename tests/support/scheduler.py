"""Nodes and a small scheduler for the test cluster (the parts of kube-scheduler berth relies on).

`Scheduler(cluster, nodes)` creates Node objects (capacity = allocatable: cpu, memory,
nvidia.com/gpu, any extended resource; labels; taints) and, on each `run_once()`, binds the
pending pods it can, oldest first, the way kube-scheduler's filters decide:

- `nodeSelector` and required node affinity (matchExpressions In / NotIn / Exists / DoesNotExist),
- taints (NoSchedule, NoExecute) against tolerations; a NotReady node (`lose()`) and a cordoned
  one (`spec.unschedulable`, tests/support/drain.py) take nothing,
- resources: the sum of the requests of the pods bound to a node (extended resources count their
  limits when no request is given, as the API server defaults them) fits its allocatable,
- required pod affinity and anti-affinity with their topologyKey (a pod that matches its own
  affinity term may start a domain where none of its peers runs yet),
- coscheduling `PodGroup`s (label scheduling.x-k8s.io/pod-group): a group's pods are bound only
  when `minMember` of them fit at once; otherwise none is.

A pod that cannot be bound gets `PodScheduled=False`, reason `Unschedulable`, with the
scheduler's message (`0/3 nodes are available: 3 Insufficient nvidia.com/gpu.`). Binding sets
`spec.nodeName` (as the test kubelet does for pods it binds itself) and `PodScheduled=True`.
Given this scheduler, either kubelet (ClusterSim's stand-in, tests/support/kubelet.py) runs only
the pods it bound and plays its lost nodes.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils import parse_quantity

from tests.support.cluster import Cluster

POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
POD_GROUPS = "scheduling.x-k8s.io/v1alpha1/podgroups"


def node(name: str, gpus: int = 0, cpu: str = "16", memory: str = "64Gi", **extra: Any) -> dict[str, Any]:
    """A Node object: `labels`, `taints` and extended resources (`resources={"rdma/ib": 1}`)."""
    allocatable = {
        "cpu": cpu,
        "memory": memory,
        "pods": "110",
        **{k: str(v) for k, v in extra.get("resources", {}).items()},
    }
    if gpus:
        allocatable["nvidia.com/gpu"] = str(gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **extra.get("labels", {})}},
        "spec": {"taints": extra.get("taints", [])},
        "status": {
            "capacity": dict(allocatable),
            "allocatable": allocatable,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def _stamp() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def requests_of(pod: Mapping[str, Any]) -> dict[str, float]:
    total: dict[str, float] = collections.defaultdict(float)
    for container in pod["spec"].get("containers", []):
        resources = container.get("resources") or {}
        requested = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in requested.items():
            total[name] += float(parse_quantity(value))
    return total


def _matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    return all(_expression(expression, labels) for expression in selector.get("matchExpressions") or [])


def _expression(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ValueError(f"the test scheduler has no operator {operator}")


def _tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        if toleration.get("operator") == "Exists" and (
            not toleration.get("key") or toleration["key"] == taint["key"]
        ):
            return True
        if toleration.get("key") == taint["key"] and toleration.get("value") == taint.get("value"):
            return True
    return False


@dataclass
class Placement:
    """Nodes and what is bound to them, as one scheduling pass sees it."""

    nodes: dict[str, dict[str, Any]]
    bound: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: collections.defaultdict(list))

    def why_not(self, pod: Mapping[str, Any], name: str) -> str | None:
        """None when `pod` fits node `name`, else kube-scheduler's reason."""
        node = self.nodes[name]
        labels = node["metadata"].get("labels") or {}
        spec = pod["spec"]
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions") or []
        )
        if not ready:
            return "node(s) were not ready"
        if node["spec"].get("unschedulable"):
            return "node(s) were unschedulable"
        for taint in node["spec"].get("taints") or []:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(
                spec.get("tolerations") or [], taint
            ):
                return f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
        selector = spec.get("nodeSelector") or {}
        node_terms = (
            ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution"
            )
            or {}
        ).get("nodeSelectorTerms")
        if any(labels.get(k) != v for k, v in selector.items()) or (
            node_terms and not any(_matches(term, labels) for term in node_terms)
        ):
            return "node(s) didn't match Pod's node affinity/selector"
        used: dict[str, float] = collections.defaultdict(float)
        for other in self.bound[name]:
            for resource, amount in requests_of(other).items():
                used[resource] += amount
        allocatable = node["status"]["allocatable"]
        for resource, amount in sorted(requests_of(pod).items()):
            if amount and used[resource] + amount > float(parse_quantity(allocatable.get(resource, "0"))):
                return f"Insufficient {resource}"
        affinity = spec.get("affinity") or {}
        pod_labels = pod["metadata"].get("labels") or {}
        for term in (affinity.get("podAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        ) or []:
            peers = self._peers(term, pod["metadata"]["namespace"])
            if peers and labels.get(term["topologyKey"]) not in {value for value, _ in peers}:
                return "node(s) didn't match pod affinity rules"
            if not peers and not _matches(term["labelSelector"], pod_labels):
                return "node(s) didn't match pod affinity rules"
        for term in (affinity.get("podAntiAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        ) or []:
            domains = {value for value, _ in self._peers(term, pod["metadata"]["namespace"])}
            if labels.get(term["topologyKey"]) in domains:
                return "node(s) didn't match pod anti-affinity rules"
        return None

    def _peers(self, term: Mapping[str, Any], namespace: str) -> list[tuple[str | None, str]]:
        """(domain value, pod name) of the bound pods a pod-affinity term selects."""
        found = []
        for node_name, pods in self.bound.items():
            domain = (self.nodes[node_name]["metadata"].get("labels") or {}).get(term["topologyKey"])
            for pod in pods:
                if pod["metadata"]["namespace"] == namespace and _matches(
                    term["labelSelector"], pod["metadata"].get("labels") or {}
                ):
                    found.append((domain, pod["metadata"]["name"]))
        return found

    def place(self, pod: dict[str, Any]) -> tuple[str | None, str]:
        """(node, "") for the first node that fits, or (None, the scheduler's message)."""
        reasons: collections.Counter[str] = collections.Counter()
        for name in sorted(self.nodes):
            reason = self.why_not(pod, name)
            if reason is None:
                self.bound[name].append(pod)
                return name, ""
            reasons[reason] += 1
        parts = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
        return None, f"0/{len(self.nodes)} nodes are available: {parts}."


@dataclass
class Scheduler:
    cluster: Cluster
    nodes: list[dict[str, Any]]
    bindings: list[tuple[str, str]] = field(default_factory=list)  # (pod, node), in order
    # ("pending" | "bound", pod): when each pod was first seen waiting for a node, and bound.
    history: list[tuple[str, str]] = field(default_factory=list)

    async def create_nodes(self) -> None:
        for obj in self.nodes:
            await self.cluster.api("POST", "/api/v1/nodes", obj)

    async def lose(self, name: str) -> None:
        """The node stops answering: NotReady, so nothing new is bound to it, and its pods are
        marked not Ready, as Kubernetes' node lifecycle controller does (no kubelet is left to
        say otherwise)."""
        await self.cluster.api(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "NodeStatusUnknown"}]}},
        )
        for pod in self.cluster.objects("v1/pods", None):
            if pod["spec"].get("nodeName") != name:
                continue
            meta = pod["metadata"]
            not_ready = {"type": "Ready", "status": "False", "reason": "NodeNotReady"}
            with contextlib.suppress(AssertionError):  # gone meanwhile
                await self.cluster.api(
                    "PATCH",
                    f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                    {"status": {"conditions": [not_ready]}},
                )

    def lost_nodes(self) -> set[str]:
        """Names of the nodes whose Ready condition is not True."""
        return {
            obj["metadata"]["name"]
            for obj in self.cluster.objects("v1/nodes", None)
            if not any(
                c["type"] == "Ready" and c["status"] == "True" for c in obj["status"].get("conditions") or []
            )
        }

    def gpus_held(self, namespace: str, deployment: str) -> int:
        """GPUs requested by the bound pods of one LLMDeployment."""
        return int(
            sum(
                requests_of(pod).get("nvidia.com/gpu", 0)
                for pod in self.cluster.objects("v1/pods", namespace)
                if pod["spec"].get("nodeName")
                and (pod["metadata"].get("labels") or {}).get("berth.dev/deployment") == deployment
                and not pod["metadata"].get("deletionTimestamp")
            )
        )

    async def run_once(self) -> None:
        nodes = {obj["metadata"]["name"]: obj for obj in self.cluster.objects("v1/nodes", None)}
        placement = Placement(nodes)
        pending = []
        for pod in self.cluster.objects("v1/pods", None):
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            where = pod["spec"].get("nodeName")
            if where in nodes:
                placement.bound[where].append(pod)
            elif not where and not pod["metadata"].get("deletionTimestamp"):
                pending.append(pod)
                if ("pending", pod["metadata"]["name"]) not in self.history:
                    self.history.append(("pending", pod["metadata"]["name"]))
        pending.sort(
            key=lambda pod: (pod["metadata"].get("creationTimestamp") or "", pod["metadata"]["name"])
        )
        groups: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
        for pod in pending:
            group = (pod["metadata"].get("labels") or {}).get(POD_GROUP_LABEL)
            groups[(pod["metadata"]["namespace"], group or f"pod:{pod['metadata']['name']}")].append(pod)
        for (namespace, group), members in groups.items():
            await self._schedule_group(placement, namespace, group, members)

    async def _schedule_group(
        self, placement: Placement, namespace: str, group: str, members: list[dict[str, Any]]
    ) -> None:
        minimum = 1
        if not group.startswith("pod:"):
            pod_group = self.cluster.get(POD_GROUPS, group, namespace)
            if pod_group is None:
                for pod in members:
                    await self._unschedulable(pod, f'podgroup "{group}" not found')
                return
            already = sum(
                1
                for pods in placement.bound.values()
                for pod in pods
                if (pod["metadata"].get("labels") or {}).get(POD_GROUP_LABEL) == group
            )
            minimum = int(pod_group["spec"].get("minMember", 1)) - already
        trial = Placement(
            placement.nodes, collections.defaultdict(list, {k: list(v) for k, v in placement.bound.items()})
        )
        chosen, message = [], ""
        for pod in members:
            where, why = trial.place(pod)
            if where is None:
                message = message or why
            else:
                chosen.append((pod, where))
        if len(chosen) < minimum:
            # All or nothing: not one pod of the group is bound (it would hold what it got).
            text = (
                f"{message} pod group {group}: {len(chosen)} of {minimum} pods fit"
                if message
                else (f"pod group {group}: waiting for {minimum} pods, {len(members)} exist")
            )
            for pod in members:
                await self._unschedulable(pod, text)
            return
        placement.bound.clear()
        placement.bound.update(trial.bound)
        for pod, where in chosen:
            await self._bind(pod, where)
        for pod in members:
            if all(pod is not other for other, _ in chosen):
                await self._unschedulable(pod, message)

    async def _bind(self, pod: dict[str, Any], node_name: str) -> None:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        try:
            await self.cluster.api("PATCH", path, {"spec": {"nodeName": node_name}})
            await self.cluster.api(
                "PATCH",
                f"{path}/status",
                {
                    "status": {
                        "conditions": [
                            {"type": "PodScheduled", "status": "True", "lastTransitionTime": _stamp()}
                        ]
                    }
                },
            )
        except AssertionError:
            return  # deleted meanwhile: the next pass sees it gone
        self.bindings.append((meta["name"], node_name))
        self.history.append(("bound", meta["name"]))

    async def _unschedulable(self, pod: dict[str, Any], message: str) -> None:
        meta = pod["metadata"]
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
        }
        current = [
            c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"
        ]
        if current and {k: current[0].get(k) for k in condition} == condition:
            return
        with contextlib.suppress(AssertionError):  # deleted meanwhile
            await self.cluster.api(
                "PATCH",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                {
                    "status": {
                        "phase": "Pending",
                        "conditions": [{**condition, "lastTransitionTime": _stamp()}],
                    }
                },
            )
