"""Per-role pod templates (operator/pod_template.py): merged over berth's pods with Kubernetes'
rules, each role's only on that role's pods, and refused where they would change what berth runs."""

from __future__ import annotations

from typing import Any

import pytest

from berth.operator import pod_template, render
from berth.operator.crd_model import InvalidSpec, parse_spec

OWNER = render.Owner(name="llama", namespace="ml", uid="1234-uid")
GPU_NODES = {"nvidia.com/gpu.product": "H100"}


def spec(**changes: Any):
    raw: dict[str, Any] = {
        "model": {"path": "/models/llama", "volume": {"mountPath": "/models", "hostPath": {"path": "/srv"}}},
        "image": "berth:1",
        "tensorParallelSize": 4,
        "gpusPerNode": 2,
        "frontends": 1,
        **changes,
    }
    return parse_spec(raw)


def pods(parsed) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """role -> (pod metadata, pod spec) as the cluster's pods will carry them."""
    found = {}
    for child in render.world_children(OWNER, parsed, 0):
        if child["kind"] == "Pod":
            found["launcher"] = (child["metadata"], child["spec"])
        elif child["kind"] in ("StatefulSet", "Deployment"):
            template = child["spec"]["template"]
            found[template["metadata"]["labels"]["berth.dev/role"]] = (template["metadata"], template["spec"])
    return found


LAUNCHER_TEMPLATE = {
    "metadata": {"annotations": {"k8s.v1.cni.cncf.io/networks": "ib-net"}, "labels": {"team": "ml"}},
    "spec": {
        "serviceAccountName": "llm-reader",
        "imagePullSecrets": [{"name": "registry"}],
        "priorityClassName": "inference",
        "initContainers": [{"name": "warm", "image": "berth:1", "command": ["true"]}],
        "volumes": [{"name": "cache", "emptyDir": {}}],
        "securityContext": {"supplementalGroups": [2000]},
        "containers": [
            {
                "name": "launcher",
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                "resources": {"limits": {"rdma/ib": 1}},
                "securityContext": {"readOnlyRootFilesystem": True},
            }
        ],
    },
}


def test_a_roles_template_reaches_that_roles_pods_only() -> None:
    rendered = pods(spec(launcher={"template": LAUNCHER_TEMPLATE}))
    plain = pods(spec())
    meta, launcher = rendered["launcher"]
    assert meta["annotations"]["k8s.v1.cni.cncf.io/networks"] == "ib-net"
    assert meta["labels"]["team"] == "ml" and meta["labels"]["berth.dev/role"] == "launcher"
    assert launcher["serviceAccountName"] == "llm-reader"
    assert launcher["imagePullSecrets"] == [{"name": "registry"}]
    assert launcher["priorityClassName"] == "inference"
    assert launcher["initContainers"] == [{"name": "warm", "image": "berth:1", "command": ["true"]}]
    assert launcher["volumes"][-1] == {"name": "cache", "emptyDir": {}}
    assert launcher["securityContext"]["supplementalGroups"] == [2000]
    assert launcher["securityContext"]["runAsUser"] == 1000  # berth's keys stay
    (container,) = launcher["containers"]
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in container["env"]
    assert container["env"][:2] == plain["launcher"][1]["containers"][0]["env"][:2]  # the engine's key first
    assert container["volumeMounts"][-1] == {"name": "cache", "mountPath": "/cache"}
    assert container["resources"]["limits"] == {"rdma/ib": "1"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["command"] == plain["launcher"][1]["containers"][0]["command"]
    # The other roles' pods are exactly what they were without the launcher's template.
    assert rendered["worker"] == plain["worker"] and rendered["frontend"] == plain["frontend"]


def test_gpu_node_selection_places_workers_only() -> None:
    rendered = pods(spec(workers={"template": {"spec": {"nodeSelector": GPU_NODES}}}))
    assert rendered["worker"][1]["nodeSelector"] == GPU_NODES
    assert "nodeSelector" not in rendered["launcher"][1] and "nodeSelector" not in rendered["frontend"][1]


def test_the_deprecated_shared_fields_keep_working() -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    rendered = pods(spec(nodeSelector=GPU_NODES, tolerations=[toleration]))
    # The shared nodeSelector selects the GPU nodes: it places the workers, not the CPU-only
    # launcher and frontends; a toleration only permits, so every role keeps it.
    assert rendered["worker"][1]["nodeSelector"] == GPU_NODES
    assert "nodeSelector" not in rendered["launcher"][1]
    assert all(pod["tolerations"] == [toleration] for _, pod in rendered.values())
    # A role's template adds to them.
    both = pods(spec(nodeSelector=GPU_NODES, workers={"template": {"spec": {"nodeSelector": {"rack": "a"}}}}))
    assert both["worker"][1]["nodeSelector"] == {**GPU_NODES, "rack": "a"}
    assert pod_template.deprecation_condition(spec(nodeSelector=GPU_NODES))["status"] == "True"
    assert "spec.nodeSelector" in pod_template.deprecation_condition(spec(nodeSelector=GPU_NODES))["message"]
    assert pod_template.deprecation_condition(spec())["status"] == "False"


def test_user_affinity_terms_are_added_to_berths() -> None:
    zone = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}]},
    }
    worker = pods(spec(workers={"template": {"spec": {"affinity": zone}}}))["worker"][1]
    assert worker["affinity"]["nodeAffinity"] == zone["nodeAffinity"]
    anti = worker["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"] == [{"weight": 1}]
    assert worker["affinity"]["podAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]  # berth's packing


@pytest.mark.parametrize(
    ("role", "template", "message"),
    [
        (
            "launcher",
            {"spec": {"containers": [{"name": "launcher", "command": ["sh", "-c", "sleep inf"]}]}},
            "spec.launcher.template.spec.containers[launcher]: command cannot be overridden",
        ),
        (
            "frontend",
            {
                "spec": {
                    "containers": [{"name": "frontend", "readinessProbe": {"exec": {"command": ["true"]}}}]
                }
            },
            "readinessProbe cannot be overridden",
        ),
        (
            "workers",
            {"spec": {"containers": [{"name": "worker", "ports": [{"containerPort": 2222}]}]}},
            "ports cannot be overridden",
        ),
        (
            "launcher",
            {
                "spec": {
                    "containers": [{"name": "launcher", "env": [{"name": "BERTH_ENGINE_KEY", "value": "x"}]}]
                }
            },
            "BERTH_ENGINE_KEY is set by berth",
        ),
        (
            "launcher",
            {"spec": {"containers": [{"name": "sidecar"}]}},
            "'sidecar' is not this role's container",
        ),
        ("workers", {"spec": {"volumes": [{"name": "ssh", "emptyDir": {}}]}}, "the name 'ssh' is berth's"),
        (
            "workers",
            {
                "spec": {
                    "containers": [
                        {"name": "worker", "volumeMounts": [{"name": "x", "mountPath": "/models"}]}
                    ]
                }
            },
            "/models is berth's",
        ),
        ("workers", {"spec": {"securityContext": {"runAsUser": 0}}}, "runAsUser is set by berth"),
        (
            "workers",
            {
                "spec": {
                    "containers": [{"name": "worker", "securityContext": {"capabilities": {"add": ["ALL"]}}}]
                }
            },
            "capabilities is set by berth",
        ),
        ("frontend", {"metadata": {"labels": {"berth.dev/role": "launcher"}}}, "'berth.dev/role' is berth's"),
        (
            "workers",
            {"spec": {"containers": [{"name": "worker", "resources": {"limits": {"nvidia.com/gpu": 8}}}]}},
            "nvidia.com/gpu comes from gpusPerNode",
        ),
    ],
)
def test_what_berth_relies_on_cannot_be_overridden(role: str, template: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpec, match=message.replace("[", r"\[").replace("]", r"\]")):
        spec(**{role: {"template": template}})


def test_the_reserved_names_are_every_name_berth_renders() -> None:
    # The validation checks names against these lists: they must hold everything berth renders.
    for _, pod in pods(spec()).values():
        assert {volume["name"] for volume in pod.get("volumes", [])} <= pod_template.RESERVED_VOLUMES
        for container in pod["containers"]:
            assert {m["mountPath"] for m in container.get("volumeMounts", [])} <= {
                *pod_template.RESERVED_MOUNT_PATHS,
                "/models",
            }
            assert set(pod.get("securityContext", {})) <= pod_template.POD_SECURITY_KEYS
            assert set(container.get("securityContext", {})) <= pod_template.CONTAINER_SECURITY_KEYS
            berth_env = {var["name"] for var in container.get("env", [])} - {"BERTH_KV_CACHE_MEMORY_FRACTION"}
            assert berth_env <= pod_template.RESERVED_ENV
