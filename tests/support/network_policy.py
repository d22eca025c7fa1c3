"""NetworkPolicies enforced in the test kubelet's pod namespaces, as a CNI plugin would: for
every pod some policy selects, an iptables INPUT chain in its namespace that accepts what the
policies allow (their peers resolved to the current pod IPs) and rejects every other new TCP
connection. Kept current while pods come and go.

Simplifications, all on the side of the tests' own traffic: only Ingress rules and TCP; peers
by podSelector (+ namespaceSelector {} or by name label) and ipBlock; the node itself (the
bridge's address: the kubelet's probes, and the test and the in-process operator, which live on
the node) is always let in, as CNIs let the kubelet in.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Mapping
from typing import Any

from tests.support.cluster import Cluster, sampling
from tests.support.kubelet import Kubelet

POLICIES = "networking.k8s.io/v1/networkpolicies"


def _matches(labels: Mapping[str, str], selector: Mapping[str, Any]) -> bool:
    if not all(labels.get(key) == value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        value, values = labels.get(expression["key"]), expression.get("values") or []
        operator = expression["operator"]
        if (
            (operator == "In" and value not in values)
            or (operator == "NotIn" and value in values)
            or (operator == "Exists" and value is None)
            or (operator == "DoesNotExist" and value is not None)
        ):
            return False
    return True


def _labels(pod: Mapping[str, Any]) -> dict[str, str]:
    return pod["metadata"].get("labels") or {}


def _sources(peer: Mapping[str, Any], namespace: str, pods: list[dict[str, Any]]) -> list[str]:
    if "ipBlock" in peer:
        return [peer["ipBlock"]["cidr"]]
    namespaces = peer.get("namespaceSelector")
    selector = peer.get("podSelector") or {}
    return [
        pod["status"]["podIP"]
        for pod in pods
        if (
            pod["metadata"]["namespace"] == namespace
            if namespaces is None
            else _matches({"kubernetes.io/metadata.name": pod["metadata"]["namespace"]}, namespaces)
        )
        and _matches(_labels(pod), selector)
    ]


def _ports(rule: Mapping[str, Any]) -> list[str]:
    ports = []
    for port in rule.get("ports") or [{}]:
        if "port" not in port:
            return ["1:65535"]
        ports.append(f"{port['port']}:{port['endPort']}" if port.get("endPort") else str(port["port"]))
    return ports


def rules_for(
    pod: Mapping[str, Any], policies: list[dict[str, Any]], pods: list[dict[str, Any]], node: str
) -> str | None:
    """The iptables-restore input for `pod`'s namespace; None when no policy selects it."""
    namespace = pod["metadata"]["namespace"]
    selecting = [
        policy
        for policy in policies
        if policy["metadata"]["namespace"] == namespace
        and "Ingress" in (policy["spec"].get("policyTypes") or ["Ingress"])
        and _matches(_labels(pod), policy["spec"].get("podSelector") or {})
    ]
    if not selecting:
        return None
    lines = [
        "*filter",
        ":INPUT ACCEPT [0:0]",
        "-A INPUT -i lo -j ACCEPT",
        "-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        f"-A INPUT -s {node} -j ACCEPT",
    ]
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            sources = (
                None if peers is None else sorted({ip for p in peers for ip in _sources(p, namespace, pods)})
            )
            for port in _ports(rule):
                if sources is None:
                    lines.append(f"-A INPUT -p tcp --dport {port} -j ACCEPT")
                for source in sources or []:
                    lines.append(f"-A INPUT -p tcp -s {source} --dport {port} -j ACCEPT")
    lines += ["-A INPUT -p tcp -j REJECT --reject-with tcp-reset", "COMMIT", ""]
    return "\n".join(lines)


class Enforcer:
    def __init__(self, cluster: Cluster, kubelet: Kubelet) -> None:
        self.cluster = cluster
        self.kubelet = kubelet
        self._applied: dict[str, str] = {}  # netns -> the rules it holds

    def sync(self) -> None:
        policies = self.cluster.objects(POLICIES)
        pods = [pod for pod in self.cluster.objects("v1/pods") if (pod.get("status") or {}).get("podIP")]
        node = self.kubelet.network.gateway
        for runtime in list(self.kubelet.pods.values()):
            if runtime.interface is None:
                continue
            netns = runtime.interface.netns
            rules = rules_for(runtime.pod, policies, pods, node) or "*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n"
            if self._applied.get(netns) == rules:
                continue
            result = subprocess.run(
                ["ip", "netns", "exec", netns, "iptables-restore"],
                input=rules,
                text=True,
                capture_output=True,
                timeout=30,
                check=False,
            )
            if result.returncode == 0:
                self._applied[netns] = rules
            # A namespace already gone (its pod deleted meanwhile) is no error.

    def running(self, interval: float = 0.2) -> contextlib.AbstractAsyncContextManager[None]:
        """Keeps the pods' rules current for as long as the block runs."""
        return sampling(lambda: asyncio.to_thread(self.sync), interval)
