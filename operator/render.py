"""Pure rendering of an LLMDeployment's children: spec in, manifests (dicts) out.

Nothing here talks to the API or reads a clock, so every field of every child is unit-tested
(tests/operator/test_render.py). Reconciling (reconcile.py) compares these with the live objects.

Per world `i` of deployment NAME (naming.py has the names):
  NAME-wI-hostfile   ConfigMap    the MPI hostfile: one line per worker pod, HOST:SLOTS
  NAME-wI            Service      headless; stable DNS for worker pods and the launcher
  NAME-wI            StatefulSet  worker pods, one per node, an SSH server waiting for mpirun
  NAME-wI-launcher   Pod          `berth launch`: mpirun over the hostfile, proxy, OpenAI server
  NAME-wI-frontend   Deployment   `berth serve --attach` (only when spec.frontends > 0)
  NAME-wI-ROLE       NetworkPolicy  ingress of the world's pods (network_policy.py; opt-out)
Per deployment: the Service NAME (the OpenAI endpoint) and three Secrets (credentials.py); with
spec.disaggregation, the Deployment NAME-router (`berth serve --route`), the Service's members.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from berth.engine.config import KV_CACHE_MEMORY_FRACTION_ENV
from berth.operator import gang, naming, network_policy, pod_template
from berth.operator.crd_model import API_VERSION, GPU_RESOURCE, KIND, LLMDeploymentSpec
from berth.operator.credentials import SSHKeyPair, b64

ENGINE_KEY_ENV = "BERTH_ENGINE_KEY"
ADMIN_TOKEN_ENV = "BERTH_ADMIN_TOKEN"
# The worker image runs an SSH server in the foreground, waiting for the launcher's mpirun;
# operator/README.md ("Images") says what its sshd_config must allow. Its host key is made in
# the pod at start (the image carries none, so no two pods, and no one who pulls the image, share
# it); a restarted container keeps the key it made. Its own directory (images/sshd_config's only
# HostKey): a key the distribution's package left in /etc/ssh is never used.
SSH_HOST_KEY = "/etc/ssh/berth/ssh_host_ed25519_key"
SSHD = "/usr/sbin/sshd"
WORKER_COMMAND = (
    "/bin/sh",
    "-c",
    f"test -f {SSH_HOST_KEY} || ssh-keygen -q -t ed25519 -N '' -f {SSH_HOST_KEY} && exec {SSHD} -De",
)
SSH_PRIVATE_KEY = "id_ed25519"
SSH_PUBLIC_KEY = "id_ed25519.pub"
SSH_AUTHORIZED_KEYS = "authorized_keys"
MODEL_VOLUME = "model"
SHM_VOLUME = "dshm"
# The image's non-root user (images/Dockerfile). Launcher and frontends run as it; mpirun's ssh
# logs in to the workers as it, so the ranks run as it too.
POD_USER = 1000
# Capabilities sshd needs as root in a worker pod (everything else is dropped): bind port 22,
# switch to the login user, chroot its privilege-separated child, signal the session it started.
SSHD_CAPABILITIES = ("NET_BIND_SERVICE", "SETUID", "SETGID", "SYS_CHROOT", "KILL", "CHOWN", "AUDIT_WRITE")
STARTUP_PROBE_PERIOD = 5
READINESS_PROBE_PERIOD = 2
READINESS_FAILURE_THRESHOLD = 3
# What a serving pod needs beyond the drain before SIGKILL: writing out the last answers (2 s),
# shutting the engine down (the MPI world's ranks, the proxy) and releasing the GPUs.
TERMINATION_MARGIN_SECONDS = 30
# The share of what a pod's memory limit leaves (after the weights, a profiled step and the
# engine's headroom) that the engine's KV pool may take: the rest is what the operator reserves
# for the pod's other processes (sshd, MPI's proxies, the HTTP server's growth under load).
# The limit itself reaches the engine through the container's memory cgroup.
KV_CACHE_MEMORY_FRACTION = "0.9"


@dataclass(frozen=True)
class Owner:
    """The LLMDeployment a child belongs to (what an ownerReference needs)."""

    name: str
    namespace: str
    uid: str


def owner_reference(owner: Owner) -> dict[str, Any]:
    # controller + blockOwnerDeletion: the garbage collector deletes children with the
    # LLMDeployment, and foreground deletion of the LLMDeployment waits for them.
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(
    owner: Owner, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": dict(labels),
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def spec_hash(pod_spec: dict[str, Any]) -> str:
    """A short digest of a pod spec: a live pod with another digest runs an outdated spec."""
    return hashlib.sha256(json.dumps(pod_spec, sort_keys=True).encode()).hexdigest()[:16]


# --- Secrets -------------------------------------------------------------------------------


def secret_metadata(owner: Owner, name: str) -> dict[str, Any]:
    return _metadata(owner, name, naming.common_labels(owner.name))


def engine_key_secret(owner: Owner, key_hex: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": secret_metadata(owner, naming.engine_key_secret(owner.name)),
        "type": "Opaque",
        "data": {"key": b64(key_hex)},
    }


def admin_token_secret(owner: Owner, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": secret_metadata(owner, naming.admin_token_secret(owner.name)),
        "type": "Opaque",
        "data": {"token": b64(token)},
    }


def ssh_secret(owner: Owner, pair: SSHKeyPair) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": secret_metadata(owner, naming.ssh_secret(owner.name)),
        "type": "Opaque",
        "data": {
            SSH_PRIVATE_KEY: b64(pair.private_openssh),
            SSH_PUBLIC_KEY: b64(pair.public_openssh),
            SSH_AUTHORIZED_KEYS: b64(pair.public_openssh),
        },
    }


# --- pieces shared by the pod templates ------------------------------------------------------


def _secret_env(owner: Owner) -> list[dict[str, Any]]:
    return [
        {
            "name": ENGINE_KEY_ENV,
            "valueFrom": {"secretKeyRef": {"name": naming.engine_key_secret(owner.name), "key": "key"}},
        },
        {
            "name": ADMIN_TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": naming.admin_token_secret(owner.name), "key": "token"}},
        },
    ]


def _user_env(spec: LLMDeploymentSpec, world: int) -> list[dict[str, Any]]:
    # Values from Secrets stay references (valueFrom): the kubelet resolves them in the pod, so
    # no secret is ever in a pod spec, a command line or the operator's memory.
    operator_env = [{"name": "BERTH_WORLD", "value": str(world)}]
    if not any(var.name == KV_CACHE_MEMORY_FRACTION_ENV for var in spec.env):  # the user's wins
        operator_env.append({"name": KV_CACHE_MEMORY_FRACTION_ENV, "value": KV_CACHE_MEMORY_FRACTION})
    return operator_env + [var.as_dict() for var in spec.env]


def _pod_security(*, as_root: bool) -> dict[str, Any]:
    """Pod-level securityContext. fsGroup makes the mounted Secrets (mode 0400, owned by root)
    readable by the image's user: group-owned by POD_USER's group and group-readable."""
    context: dict[str, Any] = {"fsGroup": POD_USER, "seccompProfile": {"type": "RuntimeDefault"}}
    if not as_root:
        context.update(runAsNonRoot=True, runAsUser=POD_USER, runAsGroup=POD_USER)
    return context


def _container_security(capabilities: tuple[str, ...] = ()) -> dict[str, Any]:
    dropped: dict[str, Any] = {"drop": ["ALL"]}
    if capabilities:
        dropped["add"] = list(capabilities)
    return {"allowPrivilegeEscalation": False, "capabilities": dropped}


def _shm_volume() -> dict[str, Any]:
    # NCCL (and torch's shared-memory transports) need more than the runtime's 64 MiB /dev/shm.
    return {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}


SHM_MOUNT = {"name": SHM_VOLUME, "mountPath": "/dev/shm"}


# What each role mounts of the Secret NAME-ssh: the launcher's mpirun logs in with the private
# key; a worker only lets that key in, so it never holds the key (a worker compromised through a
# rank cannot log in to its world's other workers).
SSH_KEYS_OF_ROLE = {"launcher": (SSH_PRIVATE_KEY,), "worker": (SSH_AUTHORIZED_KEYS,)}


def _ssh_volume(owner: Owner, role: str) -> dict[str, Any]:
    # 0400: sshd and ssh refuse keys that others can read.
    return {
        "name": "ssh",
        "secret": {
            "secretName": naming.ssh_secret(owner.name),
            "defaultMode": 0o400,
            "items": [{"key": key, "path": key} for key in SSH_KEYS_OF_ROLE[role]],
        },
    }


def _model_volumes(spec: LLMDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) for the model, empty when the image carries it."""
    volume = spec.model.volume
    if volume is None:
        return [], []
    return (
        [{"name": MODEL_VOLUME, **volume.volume_source()}],
        [{"name": MODEL_VOLUME, "mountPath": volume.mount_path, "readOnly": True}],
    )


def _http_probes(spec: LLMDeploymentSpec) -> dict[str, Any]:
    # Readiness follows the engine's admission (a parked or draining engine answers 503 at once
    # and leaves the Service); liveness only says the HTTP process answers (the operator, not the
    # kubelet, judges the engine). Readiness needs three failed checks in a row, so one slow answer
    # of a busy engine does not take a serving world out of the Service; checking every 2 s keeps
    # a parked engine's exit as quick as one failure every 5 s was (at most 6 s, during which the
    # engine answers new requests 503 + Retry-After). Each check may take 3 s, not the default 1:
    # a busy engine's answer is late, not missing. The startup probe gives the model load
    # `health.startupTimeoutSeconds` before liveness counts (a large model on a slow volume needs
    # far more than the default); it starts with the container, after scheduling and its image
    # pull, and without a gang scheduler the launcher is created only once its workers have nodes
    # (gang.launcher_may_start), so neither eats that budget.
    startup_checks = -(-spec.health.startup_timeout_seconds // STARTUP_PROBE_PERIOD)
    return {
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": READINESS_PROBE_PERIOD,
            "timeoutSeconds": 3,
            "failureThreshold": READINESS_FAILURE_THRESHOLD,
        },
        "livenessProbe": {
            "httpGet": {"path": "/live", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "startupProbe": {
            "httpGet": {"path": "/live", "port": "http"},
            "periodSeconds": STARTUP_PROBE_PERIOD,
            "failureThreshold": startup_checks,
        },
    }


def _shutdown_timeout(spec: LLMDeploymentSpec) -> list[str]:
    """A serving process stopped by its pod's deletion (an eviction, a drained node) drains like a
    world the operator sleeps: its requests in flight get `rollout.drainTimeoutSeconds`. An
    engineArgs `--shutdown-timeout` comes later on the command line and wins."""
    return ["--shutdown-timeout", str(spec.rollout.drain_timeout_seconds)]


def termination_grace_seconds(spec: LLMDeploymentSpec) -> int:
    """The grace period of launcher and frontend pods: the drain, then the engine's own shutdown,
    before the kubelet's SIGKILL. A template's `terminationGracePeriodSeconds` replaces it."""
    return spec.rollout.drain_timeout_seconds + TERMINATION_MARGIN_SECONDS


def stop_grace_seconds(spec: LLMDeploymentSpec) -> int:
    """The grace period of a world's pods the operator deletes once there is nothing left to drain
    (a dead or parked world, one released or removed): the margin alone, or a template's shorter
    grace period."""
    chosen = [
        role.template.spec.termination_grace_period_seconds
        for role in (spec.launcher, spec.workers)
        if role.template.spec.termination_grace_period_seconds is not None
    ]
    return min([TERMINATION_MARGIN_SECONDS, *chosen])


def _placement(spec: LLMDeploymentSpec, role: str) -> dict[str, Any]:
    """The deprecated shared placement: its nodeSelector (the GPU nodes) places workers only, a
    toleration only permits, so every role keeps them. The roles' templates add theirs."""
    placement: dict[str, Any] = {}
    if spec.node_selector and role == "worker":
        placement["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        placement["tolerations"] = [toleration.as_dict() for toleration in spec.tolerations]
    return placement


def worker_resources(spec: LLMDeploymentSpec) -> dict[str, dict[str, str]]:
    resources = spec.resources.as_dict()
    if spec.gpus_per_node:
        # GPUs are extended resources: requests must equal limits, so set both.
        for part in ("requests", "limits"):
            resources.setdefault(part, {})[GPU_RESOURCE] = str(spec.gpus_per_node)
    return resources


# --- per world -----------------------------------------------------------------------------


def world_role_labels(spec: LLMDeploymentSpec, deployment: str, world: int, role: str) -> dict[str, str]:
    """A world pod's labels. A disaggregated world's carry its pool, and its launcher is no
    endpoint: the router is the Service's only member (a client's request must go through it)."""
    labels = naming.role_labels(deployment, world, role)
    pool = spec.pool_of(world)
    if pool is not None:
        labels[naming.POOL] = pool
        labels.pop(naming.ENDPOINT, None)
    return labels


def hostfile(owner: Owner, spec: LLMDeploymentSpec, world: int) -> dict[str, Any]:
    slots = spec.gpus_per_node or 1
    lines = [
        f"{naming.worker_host(owner.name, owner.namespace, world, ordinal)}:{slots}"
        for ordinal in range(spec.nodes_of(world))
    ]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(
            owner, naming.hostfile_name(owner.name, world), naming.world_labels(owner.name, world)
        ),
        "data": {"hostfile": "\n".join(lines) + "\n"},
    }


def headless_service(owner: Owner, world: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(
            owner, naming.world_name(owner.name, world), naming.world_labels(owner.name, world)
        ),
        "spec": {
            "clusterIP": "None",
            # mpirun resolves worker names before anything is "ready": publish them at once.
            "publishNotReadyAddresses": True,
            "selector": naming.world_labels(owner.name, world),
            "ports": [
                {"name": "ssh", "port": naming.SSH_PORT, "targetPort": naming.SSH_PORT},
                {"name": "attach", "port": naming.ATTACH_PORT, "targetPort": naming.ATTACH_PORT},
            ],
        },
    }


def worker_pod_spec(owner: Owner, spec: LLMDeploymentSpec, world: int) -> dict[str, Any]:
    model_volumes, model_mounts = _model_volumes(spec)
    pod: dict[str, Any] = {
        **_placement(spec, "worker"),
        # sshd runs as root (it switches to the login user); the ranks it starts do not.
        "securityContext": _pod_security(as_root=True),
        "containers": [
            {
                "name": "worker",
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": list(WORKER_COMMAND),
                "ports": [{"name": "ssh", "containerPort": naming.SSH_PORT}],
                "env": _user_env(spec, world),
                "resources": worker_resources(spec),
                "readinessProbe": {"tcpSocket": {"port": "ssh"}, "periodSeconds": 5},
                "securityContext": _container_security(SSHD_CAPABILITIES),
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "volumeMounts": [
                    {"name": "ssh", "mountPath": naming.SSH_DIR, "readOnly": True},
                    dict(SHM_MOUNT),
                    *model_mounts,
                ],
            }
        ],
        "volumes": [_ssh_volume(owner, "worker"), _shm_volume(), *model_volumes],
    }
    affinity = worker_affinity(owner, spec, world)
    if affinity:
        pod["affinity"] = affinity
    return pod_template.merge_spec(pod, spec.workers.template)


def worker_affinity(owner: Owner, spec: LLMDeploymentSpec, world: int) -> dict[str, Any]:
    """Packing and topology. A worker pod holds gpusPerNode ranks and requests that many GPUs, so
    the scheduler's resource fit already keeps two pods off a node too small for both; nothing
    spreads a world that one node can hold. Its pods prefer each other's node (ranks on one node
    talk over NVLink), must share one `topologyKey` domain when one is set, and prefer domains
    where no other world of the deployment runs."""
    key = spec.workers.topology_key
    if spec.nodes_of(world) == 1 and not key:
        return {}  # one pod: nothing to pack
    own = {"labelSelector": {"matchLabels": naming.role_labels(owner.name, world, "worker")}}
    affinity: dict[str, Any] = {
        "podAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "podAffinityTerm": {**own, "topologyKey": "kubernetes.io/hostname"}}
            ]
        }
    }
    if key:
        affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] = [
            {**own, "topologyKey": key}
        ]
        others = {
            "matchLabels": {naming.DEPLOYMENT: owner.name, naming.ROLE: "worker"},
            "matchExpressions": [{"key": naming.WORLD, "operator": "NotIn", "values": [str(world)]}],
        }
        affinity["podAntiAffinity"] = {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 50, "podAffinityTerm": {"labelSelector": others, "topologyKey": key}}
            ]
        }
    return affinity


def _gang_metadata(meta: dict[str, Any], owner: Owner, spec: LLMDeploymentSpec, world: int) -> dict[str, Any]:
    """Pod metadata with the world's gang membership (berth's: after the template's)."""
    labels, annotations = gang.pod_metadata(spec, world, naming.world_name(owner.name, world))
    if labels:
        meta["labels"] = {**meta.get("labels", {}), **labels}
    if annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **annotations}
    return meta


def pod_group(owner: Owner, spec: LLMDeploymentSpec, world: int) -> dict[str, Any] | None:
    name = naming.world_name(owner.name, world)
    return gang.pod_group(_metadata(owner, name, naming.world_labels(owner.name, world)), spec, world)


def worker_statefulset(
    owner: Owner, spec: LLMDeploymentSpec, world: int, released: bool = False
) -> dict[str, Any]:
    """`released`: the world gave its pods back for lack of room (gang.py): no worker pod."""
    labels = world_role_labels(spec, owner.name, world, "worker")
    selector = {key: labels[key] for key in (naming.DEPLOYMENT, naming.WORLD, naming.ROLE)}
    pod_spec = worker_pod_spec(owner, spec, world)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(owner, naming.world_name(owner.name, world), labels),
        "spec": {
            "serviceName": naming.world_name(owner.name, world),
            "replicas": 0 if released else spec.nodes_of(world),
            # All ranks start together; ordered start-up would only delay the world.
            "podManagementPolicy": "Parallel",
            # OnDelete: a template change must not roll ranks one by one under a running MPI
            # job; the health daemon replaces the whole world instead.
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": _gang_metadata(
                    pod_template.merge_metadata(
                        {"labels": labels, "annotations": {naming.SPEC_HASH: spec_hash(pod_spec)}},
                        spec.workers.template,
                    ),
                    owner,
                    spec,
                    world,
                ),
                "spec": pod_spec,
            },
        },
    }


def launcher_command(owner: Owner, spec: LLMDeploymentSpec, world: int = 0) -> list[str]:
    command = [
        "berth",
        "launch",
        spec.model.path,
        "--hostfile",
        naming.HOSTFILE_PATH,
        "--tensor-parallel-size",
        str(spec.ranks_of(world)),
        "--gpus-per-node",
        str(spec.gpus_per_node),
        "--host",
        "0.0.0.0",
        "--port",
        str(naming.ENGINE_PORT),
        # The operator's own port (sleep, wakeup, state): the Services expose only --port.
        "--admin-port",
        str(naming.ADMIN_PORT),
        # Always: the frontend Deployment attaches here (and may be scaled up from 0 later).
        "--attach-port",
        str(naming.ATTACH_PORT),
    ]
    if spec.served_model_name:
        command += ["--served-model-name", spec.served_model_name]
    if spec.model.revision:
        command += ["--model-revision", spec.model.revision]
    return command + pool_arguments(spec, world) + _shutdown_timeout(spec) + list(spec.engine_args)


def pool_arguments(spec: LLMDeploymentSpec, world: int) -> list[str]:
    """A disaggregated world's role. A context world's rank 0 (on its first worker pod) serves
    its KV cache on every address of that pod; the handle it gives out names the pod by its
    fully qualified name (NAME-wI-0.NAME-wI.NS.svc...), which generation pods resolve. Both pools
    sign transfers with the deployment's engine key (BERTH_ENGINE_KEY, one Secret)."""
    pool = spec.pool_of(world)
    if pool is None:
        return []
    arguments = ["--role", pool]
    if pool == "context":
        arguments += ["--kv-transfer-endpoint", f"tcp://0.0.0.0:{naming.KV_TRANSFER_PORT}"]
    return arguments


def launcher_model(command: list[str]) -> tuple[str | None, str | None]:
    """(model path, revision label) a launcher command of `launcher_command` serves."""
    path = command[2] if len(command) > 2 else None
    label = command[command.index("--model-revision") + 1] if "--model-revision" in command[:-1] else None
    return path, label


def launcher_pod_spec(owner: Owner, spec: LLMDeploymentSpec, world: int) -> dict[str, Any]:
    model_volumes, model_mounts = _model_volumes(spec)
    pod = {
        # hostname + subdomain on the world's headless Service: frontends reach the launcher
        # at launcher.NAME-wI.NAMESPACE.svc whatever the pod's IP after a restart.
        "hostname": naming.LAUNCHER_HOSTNAME,
        "subdomain": naming.world_name(owner.name, world),
        # Never: a launcher whose mpirun died cannot rejoin its world; the operator restarts
        # the whole world (launcher and workers together) instead.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        **_placement(spec, "launcher"),
        "securityContext": _pod_security(as_root=False),
        "containers": [
            {
                "name": "launcher",
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": launcher_command(owner, spec, world),
                "ports": [
                    {"name": "http", "containerPort": naming.ENGINE_PORT},
                    {"name": "attach", "containerPort": naming.ATTACH_PORT},
                    {"name": "admin", "containerPort": naming.ADMIN_PORT},
                ],
                "env": _secret_env(owner) + _user_env(spec, world),
                "resources": spec.launcher_resources.as_dict(),
                **_http_probes(spec),
                "securityContext": _container_security(),
                # A launcher that dies says why in its pod's status (and so in the world's).
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "volumeMounts": [
                    {"name": "hostfile", "mountPath": naming.HOSTFILE_DIR, "readOnly": True},
                    {"name": "ssh", "mountPath": naming.SSH_DIR, "readOnly": True},
                    dict(SHM_MOUNT),
                    *model_mounts,
                ],
            }
        ],
        "volumes": [
            {"name": "hostfile", "configMap": {"name": naming.hostfile_name(owner.name, world)}},
            _ssh_volume(owner, "launcher"),
            _shm_volume(),
            *model_volumes,
        ],
    }
    return pod_template.merge_spec(pod, spec.launcher.template)


def launcher_pod(owner: Owner, spec: LLMDeploymentSpec, world: int) -> dict[str, Any]:
    pod_spec = launcher_pod_spec(owner, spec, world)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _gang_metadata(
            pod_template.merge_metadata(
                _metadata(
                    owner,
                    naming.launcher_pod_name(owner.name, world),
                    world_role_labels(spec, owner.name, world, "launcher"),
                    {naming.SPEC_HASH: spec_hash(pod_spec)},
                ),
                spec.launcher.template,
            ),
            owner,
            spec,
            world,
        ),
        "spec": pod_spec,
    }


def pod_specs_digest(owner: Owner, spec: LLMDeploymentSpec) -> str:
    """What a rollout rolls to: a digest of the pod specs the spec renders (world 0's; every
    world's differ from it only by their names, and a disaggregated deployment's by their pool:
    the last world, a generation world's, counts too)."""
    specs = {"launcher": launcher_pod_spec(owner, spec, 0), "worker": worker_pod_spec(owner, spec, 0)}
    if spec.disaggregation is not None:
        specs["generation"] = launcher_pod_spec(owner, spec, spec.replicas - 1)
    return spec_hash(specs)


def frontend_command(owner: Owner, world: int) -> list[str]:
    attach = f"tcp://{naming.launcher_host(owner.name, owner.namespace, world)}:{naming.ATTACH_PORT}"
    return ["berth", "serve", "--attach", attach, "--host", "0.0.0.0", "--port", str(naming.ENGINE_PORT)]


def frontend_deployment(owner: Owner, spec: LLMDeploymentSpec, world: int) -> dict[str, Any]:
    labels = naming.role_labels(owner.name, world, "frontend")
    selector = {key: labels[key] for key in (naming.DEPLOYMENT, naming.WORLD, naming.ROLE)}
    name = naming.frontend_name(owner.name, world)
    pod = frontend_pod_spec(owner, spec, world)
    return _non_root_deployment(owner, name, labels, selector, spec.frontends, pod, spec.frontend.template)


def frontend_pod_spec(owner: Owner, spec: LLMDeploymentSpec, world: int) -> dict[str, Any]:
    container = {
        "name": "frontend",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": frontend_command(owner, world) + _shutdown_timeout(spec),
        "ports": [{"name": "http", "containerPort": naming.ENGINE_PORT}],
        "env": _secret_env(owner) + _user_env(spec, world),
        "resources": spec.launcher_resources.as_dict(),
        **_http_probes(spec),
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    grace = termination_grace_seconds(spec)
    return _non_root_pod_spec(spec, "frontend", container, spec.frontend.template, grace)


def _non_root_pod_spec(
    spec: LLMDeploymentSpec,
    role: str,
    container: dict[str, Any],
    template: pod_template.PodTemplate,
    grace_seconds: int | None = None,
) -> dict[str, Any]:
    """A pod that runs one container as the image's user, with the role's template merged in."""
    pod = {
        **({"terminationGracePeriodSeconds": grace_seconds} if grace_seconds is not None else {}),
        **_placement(spec, role),
        "securityContext": _pod_security(as_root=False),
        "containers": [container],
    }
    return pod_template.merge_spec(pod, template)


def _non_root_deployment(
    owner: Owner,
    name: str,
    labels: dict[str, str],
    selector: dict[str, str],
    replicas: int,
    pod_spec: dict[str, Any],
    template: pod_template.PodTemplate,
) -> dict[str, Any]:
    """A Deployment of `pod_spec` pods (frontends, the activator)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, name, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": pod_template.merge_metadata({"labels": labels}, template),
                "spec": pod_spec,
            },
        },
    }


def disruption_budget(owner: Owner, world: int) -> dict[str, Any]:
    """The world's PodDisruptionBudget: no eviction of its launcher or worker pods, ever, but of
    those the operator labelled evictable once it parked the world (operator/disruption.py). A
    world is one MPI job: a drain that evicted its pods one by one would kill it mid-request,
    and several worlds at once."""
    labels = naming.world_labels(owner.name, world)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, naming.disruption_budget_name(owner.name, world), labels),
        "spec": {
            "maxUnavailable": 0,
            "selector": {
                "matchLabels": labels,
                "matchExpressions": [
                    {"key": naming.ROLE, "operator": "In", "values": ["launcher", "worker"]},
                    {"key": naming.EVICTABLE, "operator": "DoesNotExist"},
                ],
            },
        },
    }


def world_children(
    owner: Owner, spec: LLMDeploymentSpec, world: int, released: bool = False
) -> list[dict[str, Any]]:
    """Everything world `world` consists of, in creation order (the launcher pod last but one:
    its hostfile and its workers' Service exist before mpirun looks for them). A `released`
    world (gang.py) has no launcher and no worker pod until it tries again."""
    group = pod_group(owner, spec, world)
    children = [
        hostfile(owner, spec, world),
        headless_service(owner, world),
        disruption_budget(owner, world),
        *([group] if group else []),
        worker_statefulset(owner, spec, world, released),
        *([] if released else [launcher_pod(owner, spec, world)]),
    ]
    if spec.frontends:
        children.append(frontend_deployment(owner, spec, world))
    if spec.network_policy.enabled:
        # Before the pods: they start with their ingress closed (network_policy.py).
        metadata = _metadata(owner, "", naming.world_labels(owner.name, world))
        children[:0] = network_policy.world_policies(
            metadata, owner.name, world, bool(spec.frontends), spec.pool_of(world) == "context"
        )
    return children


# --- per deployment ------------------------------------------------------------------------


def activator_deployment(owner: Owner, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The pod that stays in the Service while every world sleeps or is released: it holds the
    requests and tells the operator (`berth activator`, engine/serve/activator.py)."""
    labels = {
        **naming.common_labels(owner.name),
        naming.ROLE: "activator",
        naming.COMPONENT: "activator",
        naming.ENDPOINT: "true",
    }
    selector = {key: labels[key] for key in (naming.DEPLOYMENT, naming.ROLE)}
    timeout = spec.autoscaling.idle.wake_timeout_seconds if spec.autoscaling else 300
    command = ["berth", "activator", "--host", "0.0.0.0", "--port", str(naming.ENGINE_PORT)]
    command += ["--admin-port", str(naming.ACTIVATOR_ADMIN_PORT), "--wake-timeout", str(timeout)]
    container = {
        "name": "activator",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": command,
        "ports": [
            {"name": "http", "containerPort": naming.ENGINE_PORT},
            {"name": "admin", "containerPort": naming.ACTIVATOR_ADMIN_PORT},
        ],
        "env": [_secret_env(owner)[1]],  # the admin token only
        "resources": spec.launcher_resources.as_dict(),
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/live", "port": "http"}, "periodSeconds": 10},
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    template = _frontend_placement(spec)
    pod = _non_root_pod_spec(spec, "activator", container, template)
    return _non_root_deployment(owner, naming.activator_name(owner.name), labels, selector, 1, pod, template)


def _frontend_placement(spec: LLMDeploymentSpec) -> pod_template.PodTemplate:
    """For CPU pods with no engine (activator, router), placed like the frontends: the frontend
    template's pod fields, without the containers, init containers and volumes that are its own."""
    frontend = spec.frontend.template
    return frontend.model_copy(
        update={
            "spec": frontend.spec.model_copy(update={"containers": (), "init_containers": (), "volumes": ()})
        }
    )


def router_command(owner: Owner, spec: LLMDeploymentSpec) -> list[str]:
    """`berth serve --route`: each request's prompt on a context world, its continuation on a
    generation world, both reached at their launchers' stable names."""
    routes: dict[str, list[str]] = {"context": [], "generation": []}
    for world in range(spec.replicas):
        host = naming.launcher_host(owner.name, owner.namespace, world)
        routes[spec.pool_of(world) or "context"].append(f"http://{host}:{naming.ENGINE_PORT}")
    command = ["berth", "serve"]
    for pool, urls in routes.items():
        command += ["--route", f"{pool}={','.join(urls)}"]
    return [*command, "--host", "0.0.0.0", "--port", str(naming.ENGINE_PORT), *_shutdown_timeout(spec)]


def router_deployment(owner: Owner, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The disaggregated deployment's front door: the endpoint Service's only members."""
    labels = {
        **naming.common_labels(owner.name),
        naming.ROLE: "router",
        naming.COMPONENT: "router",
        naming.ENDPOINT: "true",
    }
    selector = {key: labels[key] for key in (naming.DEPLOYMENT, naming.ROLE)}
    container = {
        "name": "router",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": router_command(owner, spec),
        "ports": [{"name": "http", "containerPort": naming.ENGINE_PORT}],
        # The user's variables only (BERTH_API_KEY, proxies): the router holds no engine secret.
        "env": [var.as_dict() for var in spec.env],
        "resources": spec.launcher_resources.as_dict(),
        **_http_probes(spec),
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    template = _frontend_placement(spec)
    pod = _non_root_pod_spec(spec, "router", container, template, termination_grace_seconds(spec))
    replicas = spec.disaggregation.router.replicas
    return _non_root_deployment(
        owner, naming.router_name(owner.name), labels, selector, replicas, pod, template
    )


def endpoint_service(owner: Owner, spec: LLMDeploymentSpec) -> dict[str, Any]:
    labels = naming.common_labels(owner.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, naming.service_name(owner.name), labels, spec.service.annotations),
        "spec": {
            "type": spec.service.type,
            # Only ready pods receive traffic: a parked or dead engine drops out by itself.
            "selector": {naming.DEPLOYMENT: owner.name, naming.ENDPOINT: "true"},
            "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def children(
    owner: Owner, spec: LLMDeploymentSpec, released: frozenset[int] = frozenset()
) -> list[dict[str, Any]]:
    """Every child except the Secrets (those are generated once, not rendered from the spec)."""
    result: list[dict[str, Any]] = []
    for world in range(spec.replicas):
        result += world_children(owner, spec, world, world in released)
    if spec.disaggregation is not None:
        result.append(router_deployment(owner, spec))
    result.append(endpoint_service(owner, spec))
    if spec.scales_to_zero:
        result.append(activator_deployment(owner, spec))
    return result
