"""Apply, don't merge: every child is written with server-side apply (field manager
berth-operator), so a field removed from the spec is removed from the child, and fields another
manager set stay. The emulator implements apply with managedFields
(tests/support/server_side_apply.py); the real `kubectl apply --server-side` behaves the same
against it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from berth.operator import naming
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.operator_runner import running_operator

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"


def managers(obj: dict[str, Any]) -> set[tuple[str, str]]:
    return {(entry["manager"], entry["operation"]) for entry in obj["metadata"].get("managedFields") or []}


async def test_fields_removed_from_the_spec_leave_the_children_and_other_managers_fields_stay(
    cluster: Cluster, tmp_path: Path
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(replicas=1, frontends=0, health={"intervalSeconds": 1, "timeoutSeconds": 1})
    doc["spec"]["nodeSelector"] = {"nvidia.com/gpu.present": "true", "pool": "a100"}
    doc["spec"]["tolerations"] = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "spot", "operator": "Exists"},
    ]
    doc["spec"]["resources"] = {"requests": {"cpu": "4"}, "limits": {"cpu": "8", "memory": "48Gi"}}
    doc["spec"]["service"] = {
        "annotations": {"lb.example.com/internal": "true", "lb.example.com/tier": "gold"}
    }
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))
    # No engines here: the controllers and a kubelet that marks pods Running are enough.
    async with ClusterSim(cluster).running(), running_operator(cluster, resync_seconds=0.5):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "llama.yaml"))
        sts = lambda: cluster.get("apps/v1/statefulsets", "llama-w0") or {}  # noqa: E731
        service = lambda: cluster.get("v1/services", "llama") or {}  # noqa: E731
        await wait_for(lambda: sts() and service(), 15, "the StatefulSet and the Service")
        # Someone else's fields: an annotation on each, by `kubectl annotate` (its own manager).
        await cluster.kubectl("annotate", "statefulset", "llama-w0", "team.example.com/owner=search")
        await cluster.kubectl("annotate", "service", "llama", "team.example.com/owner=search")

        removal = {
            "spec": {
                "nodeSelector": {"pool": None},
                "tolerations": doc["spec"]["tolerations"][:1],
                "resources": {"limits": {"cpu": None}},
                "service": {"annotations": {"lb.example.com/tier": None}},
            }
        }
        await cluster.kubectl("patch", "llmd", "llama", "--type=merge", "-p", yaml.safe_dump(removal))

        def pod_spec() -> dict[str, Any]:
            return sts()["spec"]["template"]["spec"]

        await wait_for(
            lambda: "pool" not in pod_spec().get("nodeSelector", {}), 15, "the nodeSelector key removed"
        )
        await wait_for(
            lambda: "lb.example.com/tier" not in (service()["metadata"].get("annotations") or {}),
            15,
            "the Service annotation removed",
        )
        # The launcher comes once its workers have nodes (the health loop creates it).
        await wait_for(lambda: cluster.get("v1/pods", "llama-w0-launcher"), 15, "the launcher")
    assert pod_spec()["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod_spec()["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    worker = pod_spec()["containers"][0]
    assert worker["resources"]["limits"] == {"memory": "48Gi", "nvidia.com/gpu": "1"}
    assert worker["resources"]["requests"] == {"cpu": "4", "nvidia.com/gpu": "1"}
    for child in (sts(), service()):
        annotations = child["metadata"]["annotations"]
        assert annotations["team.example.com/owner"] == "search"  # the other manager's, kept
        assert {("berth-operator", "Apply"), ("kubectl-annotate", "Update")} <= managers(child)
    assert service()["metadata"]["annotations"]["lb.example.com/internal"] == "true"
    launcher = cluster.get("v1/pods", "llama-w0-launcher")
    assert launcher["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}}
    assert naming.APPLIED in sts()["metadata"]["annotations"]


CONFIG_MAP = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {"name": "settings", "namespace": "default"},
}


async def test_kubectl_apply_server_side_against_the_emulator(cluster: Cluster, tmp_path: Path) -> None:
    path = tmp_path / "settings.yaml"

    async def apply(data: dict[str, str], *args: str, check: bool = True) -> str:
        path.write_text(yaml.safe_dump({**CONFIG_MAP, "data": data}))
        return await cluster.kubectl(
            "apply", "--server-side", "--validate=false", "-f", str(path), *args, check=check
        )

    assert "serverside-applied" in await apply({"a": "1", "b": "2"})
    await cluster.kubectl("annotate", "configmap", "settings", "note=kept")
    await apply({"a": "1"})
    stored = cluster.get("v1/configmaps", "settings")
    assert stored["data"] == {"a": "1"}  # b: applied before, not now, owned by no one else
    assert stored["metadata"]["annotations"] == {"note": "kept"}
    assert {("kubectl", "Apply"), ("kubectl-annotate", "Update")} <= managers(stored)

    # Another manager applying a different value for a field kubectl owns: a conflict, unless forced.
    with pytest.raises(AssertionError, match="conflict"):
        await apply({"a": "9"}, "--field-manager=other")
    assert cluster.get("v1/configmaps", "settings")["data"] == {"a": "1"}
    await apply({"a": "9"}, "--field-manager=other", "--force-conflicts")
    assert cluster.get("v1/configmaps", "settings")["data"] == {"a": "9"}
    # The field changed hands: kubectl no longer owns it, so kubectl's next apply without it
    # leaves it where the other manager put it.
    await apply({"c": "3"})
    assert cluster.get("v1/configmaps", "settings")["data"] == {"a": "9", "c": "3"}
