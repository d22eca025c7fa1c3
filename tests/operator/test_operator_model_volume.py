"""The model volume must be mountable by every pod that mounts it at once: a ReadWriteOnce claim
with more than one such pod is the warning condition `ModelVolumeNotShareable`. Unit tests of
the condition, then the real operator reading the claim from the emulator (and not breaking when
its RBAC refuses the read)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from berth.operator import model_volume
from berth.operator.crd_model import parse_spec
from berth.operator.kube import Kube
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.operator_runner import running_operator

LLMD = "berth.dev/v1alpha1/llmdeployments"


def spec(claim: str | None = "weights", **changes: Any):
    volume = {"mountPath": "/models", "persistentVolumeClaim": {"claimName": claim}}
    raw: dict[str, Any] = {
        "model": {"path": "/models/m", **({"volume": volume} if claim else {})},
        "image": "berth:1",
        "replicas": 2,
        "tensorParallelSize": 2,
        "gpusPerNode": 1,
    }
    raw.update(changes)
    return parse_spec(raw)


def claim(name: str, *modes: str, bound: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {"accessModes": list(modes), "resources": {"requests": {"storage": "100Gi"}}},
        "status": {"phase": "Bound", "accessModes": list(modes)} if bound else {"phase": "Pending"},
    }


def test_a_read_write_once_claim_mounted_by_several_pods_is_a_warning() -> None:
    read = model_volume.ClaimRead("weights", claim("weights", "ReadWriteOnce"))
    condition = model_volume.condition(spec(), read)
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "ModelVolumeNotShareable",
        "True",
        "ReadWriteOnce",
    )
    # 2 worlds x (a launcher + 2 worker pods): what the user must change, and to what.
    assert "weights" in condition["message"] and "6 pods" in condition["message"]
    assert "ReadOnlyMany or ReadWriteMany" in condition["message"]
    once_pod = model_volume.ClaimRead("weights", claim("weights", "ReadWriteOncePod"))
    assert model_volume.condition(spec(), once_pod)["reason"] == "ReadWriteOncePod"


def test_shareable_claims_and_other_volumes_are_no_warning() -> None:
    for modes in (("ReadOnlyMany",), ("ReadWriteMany",), ("ReadWriteOnce", "ReadOnlyMany")):
        read = model_volume.ClaimRead("weights", claim("weights", *modes))
        assert model_volume.condition(spec(), read)["status"] == "False", modes
    # An unbound claim is judged by the modes it asks for.
    pending = model_volume.ClaimRead("weights", claim("weights", "ReadWriteMany", bound=False))
    assert model_volume.access_modes(pending.claim) == ["ReadWriteMany"]
    assert model_volume.condition(spec(), pending)["status"] == "False"
    # One pod only (a world of none: replicas 0 mounts nothing at all).
    alone = model_volume.ClaimRead("weights", claim("weights", "ReadWriteOnce"))
    assert model_volume.condition(spec(replicas=0), alone)["reason"] == "Shareable"
    no_claim = model_volume.condition(spec(claim=None), None)
    assert (no_claim["status"], no_claim["reason"]) == ("False", "NoClaim")


def test_a_claim_that_cannot_be_read_is_unknown() -> None:
    missing = model_volume.condition(spec(), model_volume.ClaimRead("weights", None))
    assert (missing["status"], missing["reason"]) == ("Unknown", "ClaimNotFound")
    refused = model_volume.condition(spec(), model_volume.ClaimRead("weights", None, "HTTP 403: forbidden"))
    assert (refused["status"], refused["reason"]) == ("Unknown", "ClaimUnreadable")
    assert "HTTP 403: forbidden" in refused["message"]


def volume_condition(cluster: Cluster) -> dict[str, Any]:
    conditions = ((cluster.get(LLMD, "llama") or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == model_volume.CONDITION), {})


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_the_operator_reads_the_claim_and_a_refused_read_breaks_nothing(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet
) -> None:
    for obj in (claim("weights-rwo", "ReadWriteOnce"), claim("weights-rox", "ReadOnlyMany")):
        await cluster.api("POST", f"/api/v1/namespaces/{cluster.namespace}/persistentvolumeclaims", obj)
    # A launcher and one worker pod mount the ReadWriteOnce claim: they need not share a node.
    doc = {
        "apiVersion": "berth.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "llama"},
        "spec": {
            "model": {
                "path": "/models/m",
                "volume": {"mountPath": "/models", "persistentVolumeClaim": {"claimName": "weights-rwo"}},
            },
            "image": "berth:1",
            "gpusPerNode": 0,
            "health": {"intervalSeconds": 1, "timeoutSeconds": 1},
        },
    }

    def phase() -> str:
        return ((cluster.get(LLMD, "llama") or {}).get("status") or {}).get("phase", "")

    async def set_claim(name: str) -> None:
        patch = {"spec": {"model": {"volume": {"persistentVolumeClaim": {"claimName": name}}}}}
        await cluster.kubectl("patch", "llmd", "llama", "--type=merge", "-p", yaml.safe_dump(patch))

    async with running_operator(cluster, fleet.resolve):
        await cluster.api(
            "POST", f"/apis/berth.dev/v1alpha1/namespaces/{cluster.namespace}/llmdeployments", doc
        )
        await wait_for(lambda: volume_condition(cluster).get("status") == "True", 15, "the warning")
        assert "weights-rwo" in volume_condition(cluster)["message"]
        assert "2 pods" in volume_condition(cluster)["message"]
        # Another claim is read at once (not a recheck later): a shareable one clears it.
        await set_claim("weights-rox")
        await wait_for(lambda: volume_condition(cluster).get("reason") == "Shareable", 10, "cleared")
        # RBAC without the claim's read: the condition says so, the world comes up regardless.
        cluster.emulator.operator_agents = ("kopf/", Kube.USER_AGENT)
        cluster.emulator.authorizer = lambda request: (
            "persistentvolumeclaims is forbidden (test)"
            if request.resource is not None and request.resource.plural == "persistentvolumeclaims"
            else None
        )
        await set_claim("weights-other")
        await wait_for(lambda: volume_condition(cluster).get("reason") == "ClaimUnreadable", 10, "unreadable")
        assert "403" in volume_condition(cluster)["message"]
        await wait_for(lambda: phase() == "Ready", START_TIMEOUT, "Ready without reading the claim")
    assert cluster.emulator.forbidden, "the refused read was made"
