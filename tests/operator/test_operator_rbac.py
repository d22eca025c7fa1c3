"""The ClusterRole in manifests/ is least privilege: it allows every request the operator makes
in a full life cycle (create, scale down, a world restart, a spec change, deletion), and it
allows nothing the operator never asks for, except the few permissions listed below with why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from berth.operator.kube import Kube
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.operator_runner import running_operator

ROOT = Path(__file__).resolve().parents[2]
LLMD = "berth.dev/v1alpha1/llmdeployments"
VERBS = {"list": "list", "watch": "watch", "fetch": "get", "create": "create", "delete": "delete"}
# Granted but not exercised in this run, on purpose:
NOT_EXERCISED = {
    # A Secret's metadata is applied only when someone changed it behind the operator's back.
    ("", "secrets", "patch"),
    # Server-side apply creates these children through PATCH. An apply that creates an object
    # is admitted as a CREATE operation (admission webhooks and policies keyed on the operation
    # see a create), so the grant stays, though no request here uses the verb.
    ("", "configmaps", "create"),
    ("", "services", "create"),
    ("apps", "statefulsets", "create"),
    ("apps", "deployments", "create"),
    # No request of its own: the OwnerReferencesPermissionEnforcement admission plugin checks it
    # whenever the operator creates a child with blockOwnerDeletion: true (every child).
    ("berth.dev", "llmdeployments/finalizers", "update"),
    # Read only for a pod stuck terminating on its node (a lost node); this run loses none.
    ("", "nodes", "get"),
    # PodGroups exist only with a gang scheduler (spec.scheduling.gang); this run has none.
    *(
        (group, "podgroups", verb)
        for group in ("scheduling.x-k8s.io", "scheduling.volcano.sh")
        for verb in ("get", "create", "patch")
    ),
}


def granted() -> set[tuple[str, str, str]]:
    docs = list(yaml.safe_load_all((ROOT / "manifests" / "rbac.yaml").read_text()))
    role = next(doc for doc in docs if doc["kind"] == "ClusterRole")
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def used(cluster: Cluster) -> set[tuple[str, str, str]]:
    found = set()
    for request in list(cluster.emulator):
        agent = request.headers.get("User-Agent", "")
        if (
            request.resource is None
            or not request.resource.plural
            or not (agent.startswith("kopf/") or agent == Kube.USER_AGENT)
        ):
            continue
        action = str(request.action.value if hasattr(request.action, "value") else request.action)
        verb = "patch" if request.method.value == "PATCH" else VERBS.get(action.lower(), action)
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        found.add((request.resource.group, resource, verb))
    return found


async def patch_spec(cluster: Cluster, spec: dict[str, Any]) -> None:
    await cluster.kubectl("patch", "llmd", "llama", "--type=merge", "-p", yaml.safe_dump({"spec": spec}))


async def test_cluster_role_allows_exactly_what_the_operator_uses(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "llmdeployment.yaml").read_text())
    doc["spec"]["health"] = {"intervalSeconds": 1, "timeoutSeconds": 1}
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))

    def phase() -> str:
        return ((cluster.get(LLMD, "llama") or {}).get("status") or {}).get("phase", "")

    async with running_operator(cluster, fleet.resolve):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "llama.yaml"))
        await wait_for(lambda: phase() == "Ready", START_TIMEOUT, "Ready")
        await patch_spec(cluster, {"replicas": 1, "frontends": 0})
        await wait_for(lambda: cluster.names("apps/v1/deployments") == [], 10, "frontends pruned")
        await patch_spec(cluster, {"image": "registry.example.com/berth:0.2.0"})  # replaces the world
        await wait_for(
            lambda: "0.2.0" in str(cluster.get("v1/pods", "llama-w0-launcher") or {}), 10, "launcher replaced"
        )
        await wait_for(lambda: phase() == "Ready", START_TIMEOUT, "Ready after the spec change")
        await cluster.kubectl("delete", "llmd", "llama", "--timeout=20s", timeout=30)
        await wait_for(lambda: cluster.get(LLMD, "llama") is None, 10, "llama gone")

    allowed, requested = granted(), used(cluster)

    assert requested - allowed == set(), "the operator made requests its ClusterRole does not allow"
    assert allowed - requested - NOT_EXERCISED == set(), "the ClusterRole grants more than the operator uses"
