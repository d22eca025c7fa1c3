"""kopf runs for real against the emulator: `kubectl apply` of the example yields exactly the
children DESIGN.md lists, field by field; status reaches Ready with a real server behind each
launcher; an operator stopped half-way and started again creates no duplicates and rotates no
keys; deleting the LLMDeployment removes everything it owned."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

from berth.operator import naming, render
from berth.operator.kube import Kube
from tests.support.argocd_health import argocd_health
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.kstatus import kstatus
from tests.support.operator_runner import running_operator
from tests.support.rbac import attributes

LLMD = "berth.dev/v1alpha1/llmdeployments"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"
EXPECTED = {
    "v1/configmaps": ["llama-w0-hostfile", "llama-w1-hostfile"],
    "v1/services": ["llama", "llama-w0", "llama-w1"],
    "apps/v1/statefulsets": ["llama-w0", "llama-w1"],
    "apps/v1/deployments": ["llama-w0-frontend", "llama-w1-frontend"],
    "v1/secrets": ["llama-admin-token", "llama-engine-key", "llama-ssh"],
    "networking.k8s.io/v1/networkpolicies": [
        f"llama-w{world}-{role}" for world in (0, 1) for role in ("frontend", "launcher", "worker")
    ],
}
LAUNCHERS = ["llama-w0-launcher", "llama-w1-launcher"]
WORKERS = ["llama-w0-0", "llama-w0-1", "llama-w1-0", "llama-w1-1"]


def pods_by_role(cluster: Cluster) -> list[str]:
    """Pod names, frontend pods (NAME-wI-frontend-HASH-XXXXX) by their Deployment's name."""
    names = []
    for name in cluster.names("v1/pods"):
        if "-frontend-" in name:
            name = name.split("-frontend-")[0] + "-frontend"
        names.append(name)
    return sorted(names)


EXPECTED_PODS = sorted([*LAUNCHERS, *WORKERS, "llama-w0-frontend", "llama-w1-frontend"])


def llmd(cluster: Cluster, name: str = "llama") -> dict:
    return cluster.get(LLMD, name) or {}


def all_children_exist(cluster: Cluster) -> bool:
    return all(set(names) <= set(cluster.names(res)) for res, names in EXPECTED.items()) and set(
        LAUNCHERS
    ) <= set(cluster.names("v1/pods"))


def ready(cluster: Cluster) -> bool:
    status = llmd(cluster).get("status", {})
    return status.get("phase") == "Ready" and status.get("readyReplicas") == 2


def versions(cluster: Cluster) -> dict[str, list[tuple[str, str]]]:
    return {
        res: [(obj["metadata"]["name"], obj["metadata"]["resourceVersion"]) for obj in cluster.objects(res)]
        for res in EXPECTED
    }


def successful_reconciles() -> float:
    return REGISTRY.get_sample_value("berth_operator_reconciles_total", {"result": "success"}) or 0.0


def event_reasons(cluster: Cluster, name: str = "llama") -> list[tuple[str, str]]:
    return [
        (event["reason"], event.get("message", ""))
        for event in cluster.objects("v1/events")
        if event.get("involvedObject", {}).get("name") == name
    ]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_apply_example_creates_exactly_the_children_and_becomes_ready(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet
) -> None:
    async with running_operator(cluster, fleet.resolve):
        await cluster.kubectl("apply", "--validate=false", "-f", str(EXAMPLE))
        await wait_for(lambda: all_children_exist(cluster), 15, "every child of llama")
        await wait_for(lambda: ready(cluster), START_TIMEOUT, "llama Ready")
        # Events are posted in the background: wait for the last one before stopping.
        await wait_for(lambda: ("WorldReady", "world 1 is ready") in event_reasons(cluster), 5, "the Events")

    cr = llmd(cluster)
    uid = cr["metadata"]["uid"]
    for resource, names in EXPECTED.items():
        assert cluster.names(resource) == names, resource
    assert pods_by_role(cluster) == EXPECTED_PODS

    # Every child: owned (explicitly, as controller) by the LLMDeployment, common labels,
    # and no copy of the parent's labels (kopf.adopt would have copied them).
    operator_made = [cluster.get(res, name) for res, names in EXPECTED.items() for name in names]
    operator_made += [cluster.get("v1/pods", name) for name in LAUNCHERS]
    for child in operator_made:
        meta = child["metadata"]
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "berth.dev/v1alpha1",
                "kind": "LLMDeployment",
                "name": "llama",
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], meta["name"]
        assert meta["labels"][naming.MANAGED_BY] == "berth"
        assert meta["labels"][naming.DEPLOYMENT] == "llama"
        assert "app.kubernetes.io/instance" not in meta["labels"]

    # Worker StatefulSet: 2 pods per world, one GPU each, sshd, stable names.
    sts = cluster.get("apps/v1/statefulsets", "llama-w0")
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["serviceName"] == "llama-w0"
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    worker = sts["spec"]["template"]["spec"]["containers"][0]
    assert worker["command"] == list(render.WORKER_COMMAND)
    assert worker["resources"]["limits"] == {"memory": "48Gi", "nvidia.com/gpu": "1"}
    assert worker["resources"]["requests"] == {"cpu": "4", "memory": "48Gi", "nvidia.com/gpu": "1"}
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert sts["spec"]["template"]["metadata"]["labels"][naming.ROLE] == "worker"
    assert cluster.get("v1/services", "llama-w0")["spec"]["clusterIP"] == "None"
    assert cluster.get("v1/configmaps", "llama-w1-hostfile")["data"]["hostfile"] == (
        "llama-w1-0.llama-w1.default.svc:1\nllama-w1-1.llama-w1.default.svc:1\n"
    )

    # Launcher pod: berth launch over the hostfile, probes, secrets as env, no GPU.
    launcher = cluster.get("v1/pods", "llama-w1-launcher")
    container = launcher["spec"]["containers"][0]
    assert container["command"] == [
        "berth", "launch", "/models/llama-3.1-8b-instruct",
        "--hostfile", "/etc/berth/hostfile/hostfile",
        "--tensor-parallel-size", "2", "--gpus-per-node", "1",
        "--host", "0.0.0.0", "--port", "8000", "--admin-port", "8002", "--attach-port", "8001",
        "--served-model-name", "llama-3.1-8b-instruct", "--shutdown-timeout", "300",
        "--max-num-seqs=64",
    ]  # fmt: skip
    assert launcher["spec"]["terminationGracePeriodSeconds"] == 330  # the drain timeout + 30 s
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert "nvidia.com/gpu" not in str(container["resources"])
    env = {var["name"]: var for var in container["env"]}
    assert env["BERTH_ENGINE_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "llama-engine-key", "key": "key"}
    assert env["BERTH_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "llama-admin-token",
        "key": "token",
    }
    assert launcher["spec"]["hostname"] == "launcher" and launcher["spec"]["subdomain"] == "llama-w1"

    # Frontend: attaches to its world's launcher by stable DNS name.
    frontend = cluster.get("apps/v1/deployments", "llama-w0-frontend")
    assert frontend["spec"]["replicas"] == 1
    assert frontend["spec"]["template"]["spec"]["containers"][0]["command"][:4] == [
        "berth", "serve", "--attach", "tcp://launcher.llama-w0.default.svc:8001",
    ]  # fmt: skip

    # The endpoint Service selects serving (launcher + frontend) pods of this deployment.
    service = cluster.get("v1/services", "llama")
    assert service["spec"]["selector"] == {naming.DEPLOYMENT: "llama", naming.ENDPOINT: "true"}

    # Secrets hold real key material.
    key = base64.b64decode(cluster.get("v1/secrets", "llama-engine-key")["data"]["key"]).decode()
    assert len(bytes.fromhex(key)) == 32
    ssh = cluster.get("v1/secrets", "llama-ssh")["data"]
    assert base64.b64decode(ssh["id_ed25519"]).startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    assert base64.b64decode(ssh["authorized_keys"]).startswith(b"ssh-ed25519 ")

    # Status: Ready, with the scale subresource's fields and the endpoint.
    status = cr["status"]
    assert status["observedGeneration"] == cr["metadata"]["generation"]
    assert status["replicas"] == 2 and status["worldsReady"] == "2/2"
    assert status["selector"] == "berth.dev/deployment=llama,berth.dev/role=launcher"
    assert status["endpoint"] == "http://llama.default.svc:8000/v1"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True" and conditions["Ready"]["reason"] == "AllWorldsReady"
    assert conditions["Available"]["status"] == "True"
    assert conditions["Degraded"]["status"] == "False"
    assert [world["phase"] for world in status["worlds"]] == ["Ready", "Ready"]
    assert kstatus(cr)[0] == "Current"
    assert {c["type"]: c["status"] for c in status["conditions"]}.items() >= {
        "Reconciling": "False",
        "Stalled": "False",
    }.items()
    assert all(c["observedGeneration"] == cr["metadata"]["generation"] for c in status["conditions"])
    # The operator wrote only status: the spec is exactly what was applied.
    assert cr["spec"]["replicas"] == 2 and "kopf.zalando.org/last-handled-configuration" not in str(
        cr["metadata"]
    )

    reasons = event_reasons(cluster)
    assert ("Created", "created StatefulSet/llama-w0") in reasons
    assert ("Created", "created Secret/llama-ssh") in reasons
    assert any(reason == "WorldReady" for reason, _ in reasons)


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_operator_restarted_half_way_creates_no_duplicates(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet
) -> None:
    # Each StatefulSet create takes 0.3 s, so the operator is stopped inside its first reconcile.
    cluster.emulator.slow_creates = {"statefulsets": 0.3}
    async with running_operator(cluster, fleet.resolve):
        await cluster.kubectl("apply", "--validate=false", "-f", str(EXAMPLE))
        await wait_for(lambda: cluster.names("v1/secrets") == EXPECTED["v1/secrets"], 10, "the secrets")
    half_way = {res: cluster.names(res) for res in EXPECTED}
    assert not all_children_exist(cluster), "the first operator was meant to stop half-way"
    first_secrets = {s["metadata"]["name"]: s["data"] for s in cluster.objects("v1/secrets")}
    first_uids = {
        (res, obj["metadata"]["name"]): obj["metadata"]["uid"]
        for res in EXPECTED
        for obj in cluster.objects(res)
    }

    cluster.emulator.slow_creates = {}
    async with running_operator(cluster, fleet.resolve):
        await wait_for(lambda: all_children_exist(cluster), 15, "every child after the restart")
        await wait_for(lambda: ready(cluster), START_TIMEOUT, "llama Ready after the restart")
        settled = versions(cluster)

    reconciled_before = successful_reconciles()
    async with running_operator(cluster, fleet.resolve):
        # A third start on a finished deployment: the resume handler runs and changes nothing.
        await wait_for(lambda: successful_reconciles() > reconciled_before, 10, "the resume reconcile")
    for resource, names in EXPECTED.items():
        assert cluster.names(resource) == names, f"{resource}: duplicates or leftovers (half-way: {half_way})"
    assert pods_by_role(cluster) == EXPECTED_PODS
    for (resource, name), uid in first_uids.items():
        assert cluster.get(resource, name)["metadata"]["uid"] == uid, f"{resource}/{name} was recreated"
    # Keys were generated once and never rotated.
    assert {s["metadata"]["name"]: s["data"] for s in cluster.objects("v1/secrets")} == first_secrets
    # The third run patched nothing: every child keeps its resourceVersion.
    assert versions(cluster) == settled


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_deleting_the_llmdeployment_removes_everything_it_owned(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet
) -> None:
    async with running_operator(cluster, fleet.resolve):
        await cluster.kubectl("apply", "--validate=false", "-f", str(EXAMPLE))
        await wait_for(lambda: ready(cluster), START_TIMEOUT, "llama Ready")
        # No finalizer: the deletion waits for nobody (tests/operator/test_operator_uninstall.py).
        assert not llmd(cluster)["metadata"].get("finalizers")
        await cluster.kubectl("delete", "llmd", "llama", "--timeout=20s", timeout=30)
        await wait_for(lambda: not llmd(cluster), 10, "llama gone")
        await wait_for(
            lambda: (
                not any(
                    (obj["metadata"].get("labels") or {}).get(naming.DEPLOYMENT) == "llama"
                    for _, _, obj in cluster.all_live()
                )
            ),
            10,
            "every object labelled berth.dev/deployment=llama gone",
        )
    for resource in [*EXPECTED, "v1/pods"]:
        assert cluster.names(resource) == [], resource
    await wait_for(fleet.all_stopped, 30, "every launcher's server stopped")


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_children_changed_behind_the_operators_back_are_repaired(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    fast = yaml.safe_load(EXAMPLE.read_text())
    fast["spec"]["health"] = {"intervalSeconds": 1, "timeoutSeconds": 1}  # the daemon resyncs on its polls
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(fast))
    async with running_operator(cluster, fleet.resolve, resync_seconds=0.5):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "llama.yaml"))
        await wait_for(lambda: ready(cluster), START_TIMEOUT, "llama Ready")
        # While nothing changes, the resyncs (one per round here) read the children from the
        # watches: no GET or LIST of any of them (Secrets alone are read by name: no watch).
        # Reading them from the API server cost ~22 GETs and 7 LISTs per deployment per resync.
        before = len(list(cluster.emulator))
        await asyncio.sleep(4)
        reads = {
            (wanted.verb, wanted.resource)
            for request in list(cluster.emulator)[before:]
            if request.headers.get("User-Agent", "").startswith(("kopf/", Kube.USER_AGENT))
            and (wanted := attributes(request)) is not None
            and wanted.verb in ("get", "list")
        }
        assert reads <= {("get", "secrets")}, reads
        key_before = cluster.get("v1/secrets", "llama-engine-key")["data"]
        await cluster.api("DELETE", "/api/v1/namespaces/default/services/llama")
        await cluster.api(
            "PATCH",
            "/api/v1/namespaces/default/configmaps/llama-w0-hostfile",
            {"data": {"hostfile": "bogus\n"}},
        )
        await cluster.api(
            "PATCH",
            "/api/v1/namespaces/default/secrets/llama-engine-key",
            {"metadata": {"labels": {naming.MANAGED_BY: None}}},
        )
        await wait_for(lambda: cluster.get("v1/services", "llama") is not None, 10, "the Service recreated")
        await wait_for(
            lambda: cluster.get("v1/configmaps", "llama-w0-hostfile")["data"]["hostfile"].startswith(
                "llama-w0-0."
            ),
            10,
            "the hostfile repaired",
        )
        await wait_for(
            lambda: cluster.get("v1/secrets", "llama-engine-key")["metadata"]["labels"].get(
                naming.MANAGED_BY
            ),
            10,
            "the Secret's labels repaired",
        )
        repaired = ("Updated", "patched ConfigMap/llama-w0-hostfile back to the desired state")
        await wait_for(lambda: repaired in event_reasons(cluster), 5, "the repair's Event")
        await wait_for(
            lambda: event_reasons(cluster).count(("Created", "created Service/llama")) == 2,
            5,
            "the Service's Event",
        )
    assert cluster.get("v1/secrets", "llama-engine-key")["data"] == key_before  # repaired, not regenerated


async def test_an_invalid_spec_is_degraded_with_the_reason_and_builds_nothing(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    # An API server without the CRD's rules (an older CRD, or none): the operator's own check
    # must hold. (With them, the apply itself is refused: test_operator_crd_schema.py.)
    cluster.emulator.validate_cel = False
    bad = yaml.safe_load(EXAMPLE.read_text())
    bad["spec"].update(tensorParallelSize=3, gpusPerNode=2)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    async with running_operator(cluster, fleet.resolve):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "bad.yaml"))
        await wait_for(lambda: llmd(cluster).get("status", {}).get("phase") == "Degraded", 10, "Degraded")
        await wait_for(lambda: any(r == "InvalidSpec" for r, _ in event_reasons(cluster)), 5, "the Event")
        # Argo CD says Degraded, with the reason (the refusal answers this generation).
        await wait_for(lambda: argocd_health(llmd(cluster))["status"] == "Degraded", 10, "Argo CD Degraded")
    degraded = next(c for c in llmd(cluster)["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "tensorParallelSize must be a multiple of gpusPerNode" in degraded["message"]
    assert llmd(cluster)["status"]["observedGeneration"] == llmd(cluster)["metadata"]["generation"]
    assert "tensorParallelSize must be a multiple of gpusPerNode" in argocd_health(llmd(cluster))["message"]
    assert kstatus(llmd(cluster))[0] == "Failed"  # kstatus: it needs a human
    for resource in [*EXPECTED, "v1/pods"]:
        assert cluster.names(resource) == [], resource
