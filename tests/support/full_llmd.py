"""An LLMDeployment with every field of the operator's models set, spec and status, and the field
paths of those models: a round trip of it through the pruning emulator shows the CRD's schema
keeps everything the operator reads and writes (tests/operator/test_operator_crd_generated.py)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from berth.operator.crd import LLMDeploymentObject

TIME = "2026-12-05T10:00:00.000000Z"


def template(container: str) -> dict[str, Any]:
    """A pod template with every field set, for one role's container."""
    return {
        "metadata": {"labels": {"team": "ml"}, "annotations": {"k8s.v1.cni.cncf.io/networks": "ib0"}},
        "spec": {
            "nodeSelector": {"pool": "gpu"},
            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "priorityClassName": "inference",
            "schedulerName": "default-scheduler",
            "serviceAccountName": "llm",
            "imagePullSecrets": [{"name": "registry"}],
            "initContainers": [{"name": "warm", "image": "busybox", "command": ["true"]}],
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "securityContext": {"supplementalGroups": [2000]},
            "terminationGracePeriodSeconds": 400,
            "containers": [
                {
                    "name": container,
                    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                    "envFrom": [{"configMapRef": {"name": "nccl"}}],
                    "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                    "resources": {"limits": {"rdma/ib": "1"}},
                    "securityContext": {"readOnlyRootFilesystem": True},
                }
            ],
        },
    }


SPEC: dict[str, Any] = {
    "model": {
        "path": "/models/llama/v2",
        "name": "llama",
        "revision": "2026-12-05",
        "volume": {
            "mountPath": "/models",
            "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
        },
    },
    "image": "registry.example.com/berth:0.1.0",
    "imagePullPolicy": "Always",
    "replicas": 2,
    "tensorParallelSize": 2,
    "gpusPerNode": 1,
    "frontends": 1,
    "engineArgs": ["--max-num-seqs=64"],
    "env": [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {
            "name": "BERTH_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "api", "key": "key", "optional": False}},
        },
        {
            "name": "HF_ENDPOINT",
            "valueFrom": {"configMapKeyRef": {"name": "hub", "key": "endpoint", "optional": True}},
        },
    ],
    "resources": {"requests": {"cpu": "4", "memory": "48Gi"}, "limits": {"memory": "48Gi"}},
    "launcherResources": {"requests": {"cpu": "1"}, "limits": {"memory": "8Gi"}},
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [
        {
            "key": "nvidia.com/gpu",
            "operator": "Equal",
            "value": "x",
            "effect": "NoExecute",
            "tolerationSeconds": 60,
        }
    ],
    "launcher": {"template": template("launcher")},
    "workers": {"template": template("worker"), "topologyKey": "nvidia.com/gpu.clique"},
    "frontend": {"template": template("frontend")},
    "scheduling": {"gang": "kueue", "timeoutSeconds": 120, "queueName": "gpus"},
    "sleep": {"sleeping": False, "level": 2},
    "sleepSchedules": [
        {"name": "night", "cron": "0 22 * * 1-5", "timezone": "Europe/Berlin", "action": "Sleep", "level": 1}
    ],
    "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 60, "inPlaceWeightSwap": True},
    "health": {
        "intervalSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
        "maxRestarts": 5,
        "restartWindowSeconds": 3600,
        "backoffSeconds": 10,
        "maxBackoffSeconds": 300,
        "startupTimeoutSeconds": 600,
    },
    "service": {"type": "ClusterIP", "port": 8000, "annotations": {"example.com/lb": "internal"}},
    "autoscaling": {
        "minReplicas": 1,
        "maxReplicas": 4,
        "metric": "queueDepth",
        "target": 2.5,
        "windowSeconds": 30,
        "tolerance": 0.1,
        "scaleUp": {"stabilizationWindowSeconds": 0},
        "scaleDown": {"stabilizationWindowSeconds": 300},
        "idle": {
            "sleepAfterSeconds": 300,
            "minAwake": 1,
            "level": 1,
            "releaseAfterSeconds": 1800,
            "minWorlds": 0,
            "wakeTimeoutSeconds": 300,
        },
    },
    "networkPolicy": {"enabled": True},
}

API_ERROR = {
    "object": "Pod/llama-w0-launcher",
    "verb": "create",
    "code": 403,
    "message": 'pods "llama-w0-launcher" is forbidden: violates PodSecurity "restricted:latest"',
    "time": TIME,
    "lastTime": TIME,
    "retries": 2,
    "nextRetry": TIME,
}

STATUS: dict[str, Any] = {
    "observedGeneration": 3,
    "phase": "Progressing",
    "replicas": 2,
    "readyReplicas": 1,
    "worldsReady": "1/2",
    "selector": "berth.dev/deployment=llama,berth.dev/role=launcher",
    "endpoint": "http://llama.default.svc:8000/v1",
    "conditions": [
        {
            "type": "Ready",
            "status": "False",
            "reason": "WorldsNotReady",
            "message": "1/2 worlds ready",
            "lastTransitionTime": TIME,
            "observedGeneration": 3,
        }
    ],
    "modelRevision": "/models/llama/v2@sha256:abc",
    "nextTransition": {
        "time": TIME,
        "schedule": "night",
        "action": "Sleep",
        "level": 1,
        "heldBy": "spec.sleep",
        "message": "Sleep at level 1 at ...",
    },
    "sleepSchedule": {"seen": {"night": {"cron": "0 22 * * 1-5", "timezone": "UTC", "since": TIME}}},
    "refusal": {"generation": 2, "message": "spec.replicas: ..."},
    "worlds": [
        {
            "index": 0,
            "phase": "Ready",
            "message": "engine alive and admitting requests",
            "ready": True,
            "admission": "running",
            "launcherPod": "llama-w0-launcher",
            "pool": "context",
            "restarts": 1,
            "restartTimes": [TIME],
            "lastRestartTime": TIME,
            "lastRestartReason": "EngineDead",
            "recentRestarts": [{"time": TIME, "reason": "EngineDead", "error": "boom", "node": None}],
            "lastEngineError": "boom",
            "lastErrorTime": TIME,
            "probeFailures": 0,
            "replacedPods": ["0a2f"],
            "members": {"llama-w0-launcher": "0a2f/0"},
            "scheduling": {
                "waitingSince": TIME,
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                "attempts": 1,
                "retryAt": TIME,
            },
            "modelRevision": "/models/llama/v2@sha256:abc",
            "modelRevisionLabel": "2026-12-05",
            "sleepLevel": 0,
            "lastTransition": {
                "kind": "sleep",
                "purpose": "rollout",
                "result": "done",
                "message": "ok",
                "time": TIME,
            },
            "apiErrors": [API_ERROR],
            "tier": "awake",
        }
    ],
    "rollout": {
        "target": "0123456789abcdef",
        "done": [1],
        "inFlight": [{"world": 0, "step": "draining", "since": TIME, "drainingSince": TIME}],
        "failed": {"world": 0, "message": "world 0 did not become Ready on the new spec (Failed)"},
        "complete": False,
    },
    "conflicts": [{"kind": "Service", "name": "llama", "owner": "nobody", "world": 0}],
    "apiErrors": [API_ERROR],
    "autoscaling": {
        "metric": "queueDepth",
        "currentValue": 3.5,
        "target": 2.5,
        "desiredReplicas": 3,
        "worlds": 3,
        "asleepWorlds": [2],
        "released": True,
        "lastScaleTime": TIME,
        "lastScaleReason": "queueDepth 3.5 against target 2.5 over 2 serving world(s): 2 -> 3 world(s)",
        "lastActivityTime": TIME,
        "asleepSince": TIME,
        "heldRequests": 2,
    },
    "disruption": {
        "inFlight": [
            {"world": 1, "step": "evicting", "nodes": ["node-a"], "since": TIME, "evictingSince": TIME}
        ]
    },
    "kopf": {"progress": {"reconcile_children": {"started": TIME}}},
}


def full_object(name: str = "llama") -> dict[str, Any]:
    return {
        "apiVersion": "berth.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": copy.deepcopy(SPEC),
        "status": copy.deepcopy(STATUS),
    }


def full_objects() -> list[dict[str, Any]]:
    """The full object and variants for the fields that exclude each other (one volume source,
    disaggregation)."""
    variants = [full_object()]
    for name, source in (
        ("llama-host", {"hostPath": {"path": "/srv/models"}}),
        ("llama-nfs", {"nfs": {"server": "nfs.example.com", "path": "/models"}}),
    ):
        variant = full_object(name)
        variant["spec"]["model"]["volume"] = {"mountPath": "/models", **source}
        variants.append(variant)
    # Disaggregated: the pools' fields, without what disaggregation excludes.
    split = full_object("llama-split")
    for excluded in ("frontends", "autoscaling", "tensorParallelSize"):
        del split["spec"][excluded]
    split["spec"]["disaggregation"] = {
        "context": {"replicas": 1, "tensorParallelSize": 2},
        "generation": {"replicas": 1, "tensorParallelSize": 1},
        "router": {"replicas": 2},
    }
    variants.append(split)
    return variants


def with_refused_fields() -> dict[str, Any]:
    """The full object with the container fields a template may not set (a CEL rule refuses them,
    so no round trip carries it; the schema must still keep them for the rule to see them)."""
    document = full_object("llama-refused")
    for role in ("launcher", "workers", "frontend"):
        container = document["spec"][role]["template"]["spec"]["containers"][0]
        container.update(
            command=["sh"],
            args=["-c", "true"],
            image="other",
            ports=[{"containerPort": 9000}],
            readinessProbe={"exec": {"command": ["true"]}},
            livenessProbe={"exec": {"command": ["true"]}},
            startupProbe={"exec": {"command": ["true"]}},
        )
    return document


def model_paths() -> Iterator[str]:
    """Every field path of the operator's models ("[]" for list items), from pydantic's own view
    of them, independent of the CRD's generator."""
    raw = LLMDeploymentObject.model_json_schema(by_alias=True)
    defs = raw.get("$defs", {})

    def resolve(node: Mapping[str, Any]) -> Mapping[str, Any]:
        if "$ref" in node:
            return resolve(
                {**defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
            )
        options = [option for option in node.get("anyOf") or [] if option.get("type") != "null"]
        if len(options) == 1:
            return resolve(options[0])
        return node

    def walk(node: Mapping[str, Any], path: str) -> Iterator[str]:
        node = resolve(node)
        for key, sub in (node.get("properties") or {}).items():
            where = f"{path}.{key}" if path else key
            yield where
            yield from walk(sub, where)
        if isinstance(node.get("items"), Mapping):
            yield from walk(node["items"], f"{path}[]")

    for path in walk(raw, ""):
        if path.split(".")[0] not in ("apiVersion", "kind", "metadata"):
            yield path


def document_paths(value: Any, path: str = "") -> set[str]:
    """The field paths a document sets (list items as "[]")."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, sub in value.items():
            where = f"{path}.{key}" if path else key
            found.add(where)
            found |= document_paths(sub, where)
    elif isinstance(value, list):
        for item in value:
            found |= document_paths(item, f"{path}[]")
    return found
