"""The cluster's DNS, as /etc/hosts files: which name leads to which pod IP.

Like cluster DNS, a pod behind a headless Service is HOST.SUBDOMAIN.NS.svc (every member with
publishNotReadyAddresses, else the ready ones); a Service with a cluster IP is NAME.NS.svc. There
are no virtual IPs here, so a Service's name leads to its first ready endpoint (kube-proxy's
part; the Service's port must equal its target port). Every name also has its .cluster.local
form and, inside its own namespace, the short forms a search path would give.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tests.support.pod_state import PodRuntime

CLUSTER_DOMAIN = "cluster.local"
Table = dict[str, list[tuple[str, str]]]  # namespace -> [(ip, name relative to the namespace)]


def dns_table(pods: Iterable[PodRuntime], services: Iterable[dict[str, Any]]) -> Table:
    """namespace -> [(ip, name relative to the namespace: 'host.subdomain' or 'service')]."""
    table: Table = {}
    running = [r for r in pods if r.ip and not r.deletion.is_set()]
    for service in services:
        meta, spec = service["metadata"], service.get("spec") or {}
        namespace, selector = meta["namespace"], spec.get("selector") or {}
        members = sorted(
            (
                r
                for r in running
                if r.namespace == namespace
                and selector
                and all(r.labels.get(k) == v for k, v in selector.items())
            ),
            key=lambda r: r.name,
        )
        if spec.get("clusterIP") == "None":
            # Headless: each member pod with that subdomain gets HOST.SERVICE.
            for runtime in members:
                if runtime.spec.get("subdomain") == meta["name"] and (
                    runtime.ready or spec.get("publishNotReadyAddresses")
                ):
                    table.setdefault(namespace, []).append(
                        (runtime.ip, f"{runtime.hostname}.{meta['name']}")  # type: ignore[arg-type]
                    )
        else:
            # No virtual IPs here: the name leads to the first ready endpoint (kube-proxy's
            # job on a real node; the Service's port must equal its target port).
            ready = [r for r in members if r.ready]
            if ready:
                table.setdefault(namespace, []).append((ready[0].ip, meta["name"]))  # type: ignore[arg-type]
    return table


def hosts_file(runtime: PodRuntime, table: Table) -> str:
    """The pod's /etc/hosts: localhost, itself, and every name of the table."""
    lines = [
        "# Kubernetes-managed hosts file (the berth test kubelet).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
    ]
    own = runtime.hostname
    if runtime.spec.get("subdomain"):
        fqdn = f"{own}.{runtime.spec['subdomain']}.{runtime.namespace}.svc.{CLUSTER_DOMAIN}"
        lines.append(f"{runtime.ip}\t{fqdn}\t{own}")
    else:
        lines.append(f"{runtime.ip}\t{own}")
    for namespace, records in sorted(table.items()):
        for address, relative in records:
            names = [f"{relative}.{namespace}.svc", f"{relative}.{namespace}.svc.{CLUSTER_DOMAIN}"]
            if namespace == runtime.namespace:
                names += [relative, f"{relative}.{namespace}"]
            lines.append(f"{address}\t{' '.join(names)}")
    return "\n".join(lines) + "\n"


def lookup(table: Table, namespace: str, name: str) -> str | None:
    """What a pod's /etc/hosts says the fully qualified `name` is."""
    for address, relative in table.get(namespace, []):
        if name in (f"{relative}.{namespace}.svc", f"{relative}.{namespace}.svc.{CLUSTER_DOMAIN}"):
            return address
    return None
