"""The shipped RBAC is least privilege, in both install modes: the operator runs under exactly
the rules that `kubectl apply -k` would install (an RBAC authorizer in front of the emulator
answers 403 to any request they do not allow), through a full life cycle (create, scale down, a
world restart, a spec change, deletion); every request it makes is allowed, and the rules allow
nothing it never asks for, except the few permissions listed below with why.

- cluster-wide (`manifests/`): a ClusterRole, `berth operator --all-namespaces`;
- namespaced (`manifests/namespaced/`): a Role and RoleBinding in the watched namespace only,
  `berth operator --namespace NS`, no cluster-scoped right at all.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from berth.operator import handlers
from berth.operator.kube import Kube
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.operator_runner import running_operator
from tests.support.rbac import Authorizer, attributes

ROOT = Path(__file__).resolve().parents[2]
LLMD = "berth.dev/v1alpha1/llmdeployments"
OPERATOR_AGENTS = ("kopf/", Kube.USER_AGENT)
# The namespace manifests/namespaced/ watches; a user replaces it with theirs (as the test does).
SHIPPED_NAMESPACE = "llm-serving"
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
    ("networking.k8s.io", "networkpolicies", "create"),
    ("policy", "poddisruptionbudgets", "create"),
    # No request of its own: the OwnerReferencesPermissionEnforcement admission plugin checks it
    # whenever the operator creates a child with blockOwnerDeletion: true (every child).
    ("berth.dev", "llmdeployments/finalizers", "update"),
    # Read for the nodes of the pods: a lost node, a drained one. This run's pods get no node.
    ("", "nodes", "get"),
    # Only to release a parked world's pods to a node drain (operator/disruption.py); none here.
    ("", "pods", "patch"),
    # PodGroups exist only with a gang scheduler (spec.scheduling.gang); this run has none.
    *(
        (group, "podgroups", verb)
        for group in ("scheduling.x-k8s.io", "scheduling.volcano.sh")
        for verb in ("get", "create", "patch")
    ),
}


def built(folder: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(folder)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def install(mode: str, namespace: str) -> tuple[list[dict[str, Any]], bool]:
    """The RBAC documents of an install mode (the namespaced one moved to `namespace`, as its
    user would) and whether the operator runs cluster-wide."""
    if mode == "cluster":
        return built(ROOT / "manifests"), True
    docs = built(ROOT / "manifests" / "namespaced")
    for doc in docs:
        if doc["metadata"].get("namespace") == SHIPPED_NAMESPACE:
            doc["metadata"]["namespace"] = namespace
    return docs, False


def used(cluster: Cluster) -> set[tuple[str, str, str]]:
    found = set()
    for request in list(cluster.emulator):
        if not request.headers.get("User-Agent", "").startswith(OPERATOR_AGENTS):
            continue
        wanted = attributes(request)
        if wanted is not None:
            found.add((wanted.group, wanted.resource, wanted.verb))
    return found


def rules(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return next(doc for doc in docs if doc["kind"] == kind and doc["metadata"]["name"] == "berth-operator")[
        "rules"
    ]


def test_both_modes_grant_the_same_rules_and_the_namespaced_one_nothing_cluster_wide() -> None:
    cluster_docs, _ = install("cluster", "default")
    namespaced_docs, _ = install("namespaced", "default")
    # The same rules, but for Nodes (cluster-scoped: a Role cannot grant them; operator/disruption.py
    # does without).
    nodes = {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}
    assert [rule for rule in rules(cluster_docs, "ClusterRole") if rule != nodes] == rules(
        namespaced_docs, "Role"
    )
    assert not {doc["kind"] for doc in namespaced_docs} & {"ClusterRole", "ClusterRoleBinding"}
    deployment = next(doc for doc in namespaced_docs if doc["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"--namespace={SHIPPED_NAMESPACE}" in command and "--all-namespaces" not in command
    # Nothing cluster-scoped is read in either mode: no Namespace or CRD watch (kopf's scanning
    # is off), and Secrets are read by name only, never listed or watched.
    for granted in (Authorizer(cluster_docs).granted(None), Authorizer(namespaced_docs).granted("default")):
        resources = {resource for _, resource, _ in granted}
        assert not resources & {"namespaces", "customresourcedefinitions"}
        assert {verb for _, resource, verb in granted if resource == "secrets"} == {"get", "create", "patch"}
    assert Authorizer(namespaced_docs).granted(None) == set()
    assert Authorizer(namespaced_docs).granted("elsewhere") == set()


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
@pytest.mark.parametrize("mode", ["cluster", "namespaced"])
async def test_the_operator_runs_under_exactly_the_shipped_rules(
    mode: str, cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    docs, clusterwide = install(mode, cluster.namespace)
    authorizer = Authorizer(docs)
    cluster.emulator.authorizer = authorizer.refusal
    cluster.emulator.operator_agents = OPERATOR_AGENTS
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "llmdeployment.yaml").read_text())
    doc["spec"]["health"] = {"intervalSeconds": 1, "timeoutSeconds": 1}
    # As an older operator left it: this one takes the finalizer off (`patch`), puts none on.
    doc["metadata"]["finalizers"] = [handlers.FINALIZER]
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))

    def phase() -> str:
        return ((cluster.get(LLMD, "llama") or {}).get("status") or {}).get("phase", "")

    async def patch_spec(spec: dict[str, Any]) -> None:
        await cluster.kubectl("patch", "llmd", "llama", "--type=merge", "-p", yaml.safe_dump({"spec": spec}))

    async with running_operator(cluster, fleet.resolve, clusterwide=clusterwide):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "llama.yaml"))
        await wait_for(lambda: phase() == "Ready", START_TIMEOUT, "Ready")
        assert not cluster.get(LLMD, "llama")["metadata"].get("finalizers")
        await patch_spec({"replicas": 1, "frontends": 0})
        await wait_for(lambda: cluster.names("apps/v1/deployments") == [], 10, "frontends pruned")
        await patch_spec({"image": "registry.example.com/berth:0.2.0"})  # replaces the world
        await wait_for(
            lambda: "0.2.0" in str(cluster.get("v1/pods", "llama-w0-launcher") or {}), 10, "launcher replaced"
        )
        await wait_for(lambda: phase() == "Ready", START_TIMEOUT, "Ready after the spec change")
        await cluster.kubectl("delete", "llmd", "llama", "--timeout=20s", timeout=30)
        await wait_for(lambda: cluster.get(LLMD, "llama") is None, 10, "llama gone")

    allowed = authorizer.granted(None if clusterwide else cluster.namespace)
    requested = used(cluster)
    assert cluster.emulator.forbidden == [], "the operator made requests its rules do not allow"
    assert requested - allowed == set(), "the operator made requests its rules do not allow"
    assert allowed - requested - NOT_EXERCISED == set(), "the rules grant more than the operator uses"
