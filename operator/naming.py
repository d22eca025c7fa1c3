"""Deterministic names and labels of everything the operator owns.

Names are pure functions of the LLMDeployment's name and the world index: a resumed operator
computes the same names and finds what it created before instead of creating duplicates.

Labels deliberately leave out `app.kubernetes.io/instance`: Argo CD tracks resources by that
label by default, and children carrying the application's instance label would be taken for
out-of-sync members of the Git application (the reason kopf's `adopt()` is not used either).
"""

from __future__ import annotations

MANAGED_BY = "app.kubernetes.io/managed-by"
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT = "app.kubernetes.io/component"
DEPLOYMENT = "berth.dev/deployment"
WORLD = "berth.dev/world"
ROLE = "berth.dev/role"
# Launcher and frontend pods both serve the OpenAI API; a Service selector cannot say
# "role in (launcher, frontend)", so serving pods carry one more label the Service selects.
ENDPOINT = "berth.dev/endpoint"
SPEC_HASH = "berth.dev/spec-hash"
# The digest of the rendering the operator last applied to a child (reconcile.applied_config).
APPLIED = "berth.dev/applied"
# A disaggregated deployment's world pods: the pool (context | generation) the world belongs to.
POOL = "berth.dev/pool"
# On a world's pods that a node drain may evict: the world is parked (operator/disruption.py),
# and its PodDisruptionBudget selects only pods without this label.
EVICTABLE = "berth.dev/evictable"

ROLES = ("launcher", "worker", "frontend")

ENGINE_PORT = 8000  # the OpenAI server in launcher and frontend pods
ATTACH_PORT = 8001  # the launcher's attach port for frontends
ACTIVATOR_ADMIN_PORT = 8002  # the activator's port for the operator (no Service exposes it)
ADMIN_PORT = 8002  # the launcher's /admin routes: for the operator only, no Service exposes it
SSH_PORT = 22
# Where a context world's rank 0 (on its first worker pod) serves its KV cache to generation worlds.
KV_TRANSFER_PORT = 8003

HOSTFILE_DIR = "/etc/berth/hostfile"
HOSTFILE_PATH = f"{HOSTFILE_DIR}/hostfile"
SSH_DIR = "/etc/berth/ssh"
LAUNCHER_HOSTNAME = "launcher"


def world_name(deployment: str, world: int) -> str:
    """The world's StatefulSet, headless Service and pod-name prefix."""
    return f"{deployment}-w{world}"


def disruption_budget_name(deployment: str, world: int) -> str:
    return world_name(deployment, world)


def hostfile_name(deployment: str, world: int) -> str:
    return f"{world_name(deployment, world)}-hostfile"


def launcher_pod_name(deployment: str, world: int) -> str:
    return f"{world_name(deployment, world)}-launcher"


def frontend_name(deployment: str, world: int) -> str:
    return f"{world_name(deployment, world)}-frontend"


def worker_pod_name(deployment: str, world: int, ordinal: int) -> str:
    """The name the StatefulSet controller gives worker `ordinal`."""
    return f"{world_name(deployment, world)}-{ordinal}"


def router_name(deployment: str) -> str:
    """The router Deployment of a disaggregated deployment."""
    return f"{deployment}-router"


def activator_name(deployment: str) -> str:
    return f"{deployment}-activator"


def service_name(deployment: str) -> str:
    """The deployment's OpenAI endpoint Service has the deployment's own name."""
    return deployment


def engine_key_secret(deployment: str) -> str:
    return f"{deployment}-engine-key"


def admin_token_secret(deployment: str) -> str:
    return f"{deployment}-admin-token"


def ssh_secret(deployment: str) -> str:
    return f"{deployment}-ssh"


def worker_host(deployment: str, namespace: str, world: int, ordinal: int) -> str:
    """Stable DNS name of a worker pod (StatefulSet pod + headless Service)."""
    return f"{worker_pod_name(deployment, world, ordinal)}.{world_name(deployment, world)}.{namespace}.svc"


def launcher_host(deployment: str, namespace: str, world: int) -> str:
    """Stable DNS name of the launcher pod (hostname + subdomain on the world's headless Service)."""
    return f"{LAUNCHER_HOSTNAME}.{world_name(deployment, world)}.{namespace}.svc"


def endpoint_url(deployment: str, namespace: str, port: int) -> str:
    """The OpenAI base URL clients in the cluster use."""
    return f"http://{service_name(deployment)}.{namespace}.svc:{port}/v1"


def common_labels(deployment: str) -> dict[str, str]:
    return {MANAGED_BY: "berth", NAME_LABEL: "berth", DEPLOYMENT: deployment}


def world_labels(deployment: str, world: int) -> dict[str, str]:
    return {**common_labels(deployment), WORLD: str(world)}


def role_labels(deployment: str, world: int, role: str) -> dict[str, str]:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    labels = {**world_labels(deployment, world), ROLE: role, COMPONENT: role}
    if role in ("launcher", "frontend"):
        labels[ENDPOINT] = "true"
    return labels


def launcher_selector(deployment: str) -> str:
    """The scale subresource's selector: the launcher pods, one per world."""
    return f"{DEPLOYMENT}={deployment},{ROLE}=launcher"
