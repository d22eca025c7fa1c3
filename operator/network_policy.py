"""The NetworkPolicies of a world: ingress to its pods closed but for what berth uses.

Per world `i` of deployment NAME (spec.networkPolicy.enabled, on by default):
  NAME-wI-launcher  the launcher: the OpenAI port (8000) from anywhere (clients, the Service,
                    the kubelet's probes); the attach port (8001) from this world's frontends;
                    the admin port (8002) from the operator's pods; the MPI / collective range
                    (1024-65535: hydra's proxies, the engine's queues, gloo / NCCL) from this
                    world's workers.
  NAME-wI-worker    the workers: SSH (22) from this world's launcher; the MPI / collective range
                    from this world's launcher and workers.
  NAME-wI-frontend  the frontends: the OpenAI port from anywhere; the collective range from
                    this world's launcher (the engine's result lanes).
A disaggregated context world's workers also take the KV transfer port (8003) from the
deployment's workers (generation ranks pull there); the router pods, like the activator, have
no policy (they take the OpenAI port from anywhere and hold no engine).
Everything else to these pods is denied (a policy that selects a pod denies what it does not
allow). Egress stays open: the pods reach the model store, and each other as allowed above.
"""

from __future__ import annotations

from typing import Any

from berth.operator import naming

API_VERSION = "networking.k8s.io/v1"
# Hydra's proxies, the engine's ZeroMQ queues and torch.distributed's rendezvous and collectives
# listen on ephemeral ports: a world's pods open this range to each other, and to nobody else.
EPHEMERAL = {"protocol": "TCP", "port": 1024, "endPort": 65535}
# The operator's pods (manifests/base/deployment.yaml), in whatever namespace it runs.
OPERATOR_PODS = {
    "namespaceSelector": {},
    "podSelector": {"matchLabels": {naming.NAME_LABEL: "berth-operator"}},
}


def _port(number: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": number}


def _peers(deployment: str, world: int, *roles: str) -> list[dict[str, Any]]:
    return [{"podSelector": {"matchLabels": _selector(deployment, world, role)}} for role in roles]


def _selector(deployment: str, world: int, role: str) -> dict[str, str]:
    return {naming.DEPLOYMENT: deployment, naming.WORLD: str(world), naming.ROLE: role}


def _policy(
    metadata: dict[str, Any], deployment: str, world: int, role: str, ingress: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": {**metadata, "name": f"{naming.world_name(deployment, world)}-{role}"},
        "spec": {
            "podSelector": {"matchLabels": _selector(deployment, world, role)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def world_policies(
    metadata: dict[str, Any], deployment: str, world: int, frontends: bool, serves_kv: bool = False
) -> list[dict[str, Any]]:
    """The world's policies; `metadata`: namespace, labels and owner reference (render.py's).
    `serves_kv`: a disaggregated context world, whose rank 0 serves its KV cache to the
    deployment's other workers (the generation worlds' ranks) on KV_TRANSFER_PORT."""
    workers = {"podSelector": {"matchLabels": {naming.DEPLOYMENT: deployment, naming.ROLE: "worker"}}}
    kv_transfer = [{"ports": [_port(naming.KV_TRANSFER_PORT)], "from": [workers]}]
    policies = [
        _policy(
            metadata,
            deployment,
            world,
            "launcher",
            [
                {"ports": [_port(naming.ENGINE_PORT)]},
                {"ports": [_port(naming.ATTACH_PORT)], "from": _peers(deployment, world, "frontend")},
                {"ports": [_port(naming.ADMIN_PORT)], "from": [OPERATOR_PODS]},
                {"ports": [EPHEMERAL], "from": _peers(deployment, world, "worker")},
            ],
        ),
        _policy(
            metadata,
            deployment,
            world,
            "worker",
            [
                {"ports": [_port(naming.SSH_PORT)], "from": _peers(deployment, world, "launcher")},
                {"ports": [EPHEMERAL], "from": _peers(deployment, world, "launcher", "worker")},
                *(kv_transfer if serves_kv else []),
            ],
        ),
    ]
    if frontends:
        policies.append(
            _policy(
                metadata,
                deployment,
                world,
                "frontend",
                [
                    {"ports": [_port(naming.ENGINE_PORT)]},
                    {"ports": [EPHEMERAL], "from": _peers(deployment, world, "launcher")},
                ],
            )
        )
    return policies
