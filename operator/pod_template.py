"""Per-role pod templates: what users may add to the pods berth renders, and the merge.

`spec.launcher.template`, `spec.workers.template` and `spec.frontend.template` are partial pod
templates (metadata and a few spec fields). They are merged over the pod berth renders with
Kubernetes' own rules: maps key by key, lists of named things (containers, volumes, env,
imagePullSecrets, initContainers) by name, tolerations appended. What berth relies on (a
container's command, args, image, ports and probes; the engine's environment; berth's labels,
volumes and mount points) is not overridable: a template that tries is an invalid spec, with a
message that names the field, never a silently different pod.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from berth.operator import naming
from berth.operator.quantity import Quantity, canonical_quantity, check_quantity

# What berth renders and a template must not replace (operator/render.py renders them; a test
# checks every rendered name is listed here).
RESERVED_VOLUMES = frozenset({"ssh", "dshm", "model", "hostfile"})
RESERVED_MOUNT_PATHS = frozenset({naming.SSH_DIR, naming.HOSTFILE_DIR, "/dev/shm"})
# securityContext keys berth sets: what its pods were checked with (a sshd without its
# capabilities, a launcher as root, a Secret unreadable without the fsGroup).
POD_SECURITY_KEYS = frozenset({"fsGroup", "seccompProfile", "runAsNonRoot", "runAsUser", "runAsGroup"})
CONTAINER_SECURITY_KEYS = frozenset({"allowPrivilegeEscalation", "capabilities"})
RESERVED_ENV = frozenset({"BERTH_ENGINE_KEY", "BERTH_ADMIN_TOKEN", "BERTH_WORLD"})
RESERVED_LABEL_PREFIXES = ("berth.dev/", "app.kubernetes.io/")
# Container fields berth renders from the spec: a pod running another command is not a world.
FIXED_CONTAINER_FIELDS = (
    "command",
    "args",
    "image",
    "ports",
    "readinessProbe",
    "livenessProbe",
    "startupProbe",
)
CONTAINER_OF_ROLE = {"launcher": "launcher", "worker": "worker", "frontend": "frontend"}
GPU_RESOURCE = "nvidia.com/gpu"


class _Model(BaseModel):
    model_config = ConfigDict(
        populate_by_name=True,
        extra="ignore",
        frozen=True,
        alias_generator=lambda name: name.split("_")[0] + "".join(p.title() for p in name.split("_")[1:]),
        use_attribute_docstrings=True,
    )


# Free-form Kubernetes objects as list items (the API server validates them in the pod).
EnvVar = Annotated[dict[str, Any], Field(description="A Kubernetes EnvVar.")]
EnvFromSource = Annotated[dict[str, Any], Field(description="A Kubernetes EnvFromSource.")]
VolumeMount = Annotated[dict[str, Any], Field(description="A Kubernetes VolumeMount.")]
ContainerPort = Annotated[dict[str, Any], Field(description="A container port.")]
Toleration = Annotated[dict[str, Any], Field(description="A Kubernetes Toleration.")]
Container = Annotated[dict[str, Any], Field(description="A Kubernetes Container.")]
Volume = Annotated[dict[str, Any], Field(description="A Kubernetes Volume.")]
SecretReference = Annotated[dict[str, str], Field(description="{name: SECRET}.")]
Argument = Annotated[str, Field(description="An argument.")]


def _cel(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


class TemplateMetadata(_Model):
    """Labels and annotations added to the role's pods (e.g. a Multus network annotation)."""

    labels: dict[str, str] = Field(default_factory=dict)
    """Extra pod labels; keys under berth.dev/ and app.kubernetes.io/ are berth's."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Extra pod annotations."""


class ContainerPatch(_Model):
    """Additions to one of berth's containers, merged by name (`launcher`, `worker`, `frontend`)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": "!(" + " || ".join(f"has(self.{name})" for name in FIXED_CONTAINER_FIELDS) + ")",
                "message": "a pod template may not set a container's "
                + ", ".join(FIXED_CONTAINER_FIELDS)
                + ": berth renders them from the spec (use engineArgs for engine flags)",
            }
        )
    )

    name: str = Field(min_length=1)
    """The container to add to: launcher, worker or frontend (the role's own)."""
    env: tuple[EnvVar, ...] = ()
    """Extra environment variables (Kubernetes EnvVar: value or valueFrom), merged by name."""
    env_from: tuple[EnvFromSource, ...] = ()
    """Extra envFrom sources (ConfigMaps, Secrets)."""
    volume_mounts: tuple[VolumeMount, ...] = ()
    """Extra volume mounts (of the template's volumes)."""
    resources: dict[str, dict[str, Quantity]] = Field(default_factory=dict)
    """Extra requests / limits, e.g. `rdma/ib: 1`; merged key by key over berth's."""
    security_context: dict[str, Any] = Field(default_factory=dict)
    """Additions to the container's securityContext (a key berth sets cannot change)."""
    # Declared so that an API server keeps them for the rule above (it would prune them).
    command: tuple[Argument, ...] | None = None
    """Not allowed: berth renders the command."""
    args: tuple[Argument, ...] | None = None
    """Not allowed: berth renders the arguments."""
    image: str | None = None
    """Not allowed: spec.image."""
    ports: tuple[ContainerPort, ...] | None = None
    """Not allowed: berth renders the ports."""
    readiness_probe: dict[str, Any] | None = None
    """Not allowed: berth renders the probes."""
    liveness_probe: dict[str, Any] | None = None
    """Not allowed: berth renders the probes."""
    startup_probe: dict[str, Any] | None = None
    """Not allowed: berth renders the probes (health.startupTimeoutSeconds)."""


class PodSpecPatch(_Model):
    """The pod spec fields a template may set."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels this role's pods must match (e.g. a GPU product for workers only)."""
    affinity: dict[str, Any] = Field(default_factory=dict)
    """Kubernetes affinity; its terms are added to berth's (workers' packing and topology)."""
    tolerations: tuple[Toleration, ...] = ()
    """Tolerations added to this role's pods."""
    priority_class_name: str | None = None
    """PriorityClass of this role's pods."""
    scheduler_name: str | None = None
    """Scheduler of this role's pods (a gang scheduler: spec.scheduling.gang)."""
    service_account_name: str | None = None
    """ServiceAccount this role's pods run as."""
    image_pull_secrets: tuple[SecretReference, ...] = ()
    """Secrets for pulling the image (`{name: ...}`)."""
    init_containers: tuple[Container, ...] = ()
    """Init containers run before berth's container (full Kubernetes containers)."""
    volumes: tuple[Volume, ...] = ()
    """Extra volumes (mount them with containers[].volumeMounts); berth's names are reserved."""
    containers: tuple[ContainerPatch, ...] = ()
    """Additions to berth's container, by name."""
    security_context: dict[str, Any] = Field(default_factory=dict)
    """Additions to the pod's securityContext (supplementalGroups, sysctls, ...)."""
    termination_grace_period_seconds: int | None = Field(default=None, ge=0)
    """Seconds between SIGTERM and SIGKILL on deletion (default: berth's)."""


class PodTemplate(_Model):
    """A partial pod template merged over what berth renders for one role."""

    metadata: TemplateMetadata = Field(default_factory=TemplateMetadata)
    """Labels and annotations of the role's pods."""
    spec: PodSpecPatch = Field(default_factory=PodSpecPatch)
    """Pod spec additions."""


def template_problems(role: str, template: PodTemplate, mount_paths: Iterable[str] = ()) -> list[str]:
    """Why `template` cannot be merged over berth's pod for `role` (empty: it can).
    `mount_paths`: where berth mounts volumes beyond RESERVED_MOUNT_PATHS (the model's)."""
    mount_paths = {*RESERVED_MOUNT_PATHS, *mount_paths}
    where = f"spec.{'workers' if role == 'worker' else role}.template"
    problems = []
    for key in template.metadata.labels:
        if key.startswith(RESERVED_LABEL_PREFIXES):
            problems.append(
                f"{where}.metadata.labels: {key!r} is berth's (keys under berth.dev/, app.kubernetes.io/)"
            )
    berths = [key for key in template.spec.security_context if key in POD_SECURITY_KEYS]
    if berths:
        problems.append(f"{where}.spec.securityContext: {', '.join(berths)} is set by berth")
    for volume in template.spec.volumes:
        if volume.get("name") in RESERVED_VOLUMES:
            problems.append(f"{where}.spec.volumes: the name {volume.get('name')!r} is berth's")
    own = CONTAINER_OF_ROLE[role]
    for container in template.spec.containers:
        at = f"{where}.spec.containers[{container.name}]"
        if container.name != own:
            problems.append(
                f"{where}.spec.containers: {container.name!r} is not this role's container "
                f"(the {role} pod has one container, {own!r}; add processes as initContainers)"
            )
        fixed = [name for name in FIXED_CONTAINER_FIELDS if getattr(container, _snake(name)) is not None]
        if fixed:
            problems.append(
                f"{where}.spec.containers[{container.name}]: {', '.join(fixed)} cannot be overridden: "
                "berth renders them from the spec (use engineArgs for engine flags)"
            )
        berths = [key for key in container.security_context if key in CONTAINER_SECURITY_KEYS]
        if berths:
            problems.append(f"{at}.securityContext: {', '.join(berths)} is set by berth")
        taken = [m.get("mountPath") for m in container.volume_mounts if m.get("mountPath") in mount_paths]
        if taken:
            problems.append(
                f"{where}.spec.containers[{container.name}].volumeMounts: {', '.join(taken)} is berth's"
            )
        for var in container.env:
            if var.get("name") in RESERVED_ENV:
                problems.append(
                    f"{where}.spec.containers[{container.name}].env: {var.get('name')} is set by berth "
                    "(the engine's key, admin token and world index)"
                )
        for part, quantities in container.resources.items():
            for key, value in quantities.items():
                try:
                    check_quantity(value, f"{at}.resources.{part}.{key}")
                except ValueError as error:
                    problems.append(str(error))
            if GPU_RESOURCE in quantities:
                problems.append(
                    f"{where}.spec.containers[{container.name}].resources.{part}: {GPU_RESOURCE} comes from "
                    "gpusPerNode"
                )
    for container in template.spec.init_containers:
        if not container.get("name"):
            problems.append(f"{where}.spec.initContainers: every init container needs a name")
    return problems


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


# --- the merge ----------------------------------------------------------------------------------


def _by_name(
    base: Iterable[Mapping[str, Any]], extra: Iterable[Mapping[str, Any]], key: str = "name"
) -> list:
    """Kubernetes' strategic merge of a list keyed by `key`: an entry of `extra` replaces the one
    of `base` with the same key, the others are appended in order."""
    merged = {item[key]: dict(item) for item in base}
    for item in extra:
        merged[item[key]] = dict(item)
    return list(merged.values())


def _merge_affinity(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Affinity terms are ANDed (required) or summed (preferred): both sides' terms are kept."""
    merged = copy.deepcopy(dict(base))
    for kind, rules in extra.items():
        target = merged.setdefault(kind, {})
        for rule, value in rules.items():
            if rule == "requiredDuringSchedulingIgnoredDuringExecution" and kind == "nodeAffinity":
                # Node selector terms are ORed: each of berth's terms must hold with each of the user's.
                terms = target.get(rule, {}).get("nodeSelectorTerms") or [{}]
                target[rule] = {
                    "nodeSelectorTerms": [
                        {key: [*mine.get(key, []), *theirs.get(key, [])] for key in {*mine, *theirs}}
                        for mine in terms
                        for theirs in value.get("nodeSelectorTerms") or [{}]
                    ]
                }
            else:
                target[rule] = [*target.get(rule, []), *value]
    return merged


def _merge_container(container: dict[str, Any], patch: ContainerPatch) -> None:
    if patch.env:
        container["env"] = _by_name(container.get("env", []), patch.env)
    if patch.env_from:
        container["envFrom"] = [*container.get("envFrom", []), *patch.env_from]
    if patch.volume_mounts:
        taken = {mount["mountPath"] for mount in container.get("volumeMounts", [])}
        clash = [mount["mountPath"] for mount in patch.volume_mounts if mount.get("mountPath") in taken]
        if clash:
            raise ValueError(f"containers[{patch.name}].volumeMounts: {', '.join(clash)} is mounted by berth")
        container["volumeMounts"] = [*container.get("volumeMounts", []), *patch.volume_mounts]
    for part, quantities in patch.resources.items():
        target = container.setdefault("resources", {}).setdefault(part, {})
        target.update({key: canonical_quantity(value) for key, value in quantities.items()})
    if patch.security_context:
        container["securityContext"] = _add_keys(
            container.get("securityContext", {}),
            patch.security_context,
            f"containers[{patch.name}].securityContext",
        )


def _add_keys(base: Mapping[str, Any], extra: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`extra`'s keys added to `base`; a key `base` holds with another value is an error (berth's
    security settings are what its pods were checked with: a sshd without its capabilities, a
    launcher as root, a Secret unreadable without the fsGroup)."""
    changed = [key for key, value in extra.items() if key in base and base[key] != value]
    if changed:
        raise ValueError(f"{where}: {', '.join(changed)} is set by berth and cannot be changed")
    return {**base, **extra}


def merge_metadata(metadata: Mapping[str, Any], template: PodTemplate) -> dict[str, Any]:
    """Pod metadata with the template's labels and annotations added (berth's keys win)."""
    meta = copy.deepcopy(dict(metadata))
    if template.metadata.labels:
        meta["labels"] = {**template.metadata.labels, **meta.get("labels", {})}
    if template.metadata.annotations:
        meta["annotations"] = {**template.metadata.annotations, **meta.get("annotations", {})}
    return meta


def merge_spec(pod_spec: Mapping[str, Any], template: PodTemplate) -> dict[str, Any]:
    """A pod spec with `template` merged over berth's rendering. Raises ValueError on a field
    berth owns (the spec's validation refuses those first: this only guards)."""
    spec = copy.deepcopy(dict(pod_spec))
    patch = template.spec
    if patch.node_selector:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **patch.node_selector}
    if patch.affinity:
        spec["affinity"] = _merge_affinity(spec.get("affinity", {}), patch.affinity)
    if patch.tolerations:
        present = spec.get("tolerations", [])
        spec["tolerations"] = [*present, *(t for t in patch.tolerations if t not in present)]
    for field, value in (
        ("priorityClassName", patch.priority_class_name),
        ("schedulerName", patch.scheduler_name),
        ("serviceAccountName", patch.service_account_name),
        ("terminationGracePeriodSeconds", patch.termination_grace_period_seconds),
    ):
        if value is not None:
            spec[field] = value
    if patch.image_pull_secrets:
        spec["imagePullSecrets"] = _by_name(spec.get("imagePullSecrets", []), patch.image_pull_secrets)
    if patch.init_containers:
        spec["initContainers"] = _by_name(spec.get("initContainers", []), patch.init_containers)
    if patch.volumes:
        own = {volume["name"] for volume in spec.get("volumes", [])}
        clash = [volume["name"] for volume in patch.volumes if volume["name"] in own]
        if clash:
            raise ValueError(f"volumes: {', '.join(clash)} is berth's")
        spec["volumes"] = [*spec.get("volumes", []), *patch.volumes]
    if patch.security_context:
        spec["securityContext"] = _add_keys(
            spec.get("securityContext", {}), patch.security_context, "securityContext"
        )
    containers = {container["name"]: container for container in spec.get("containers", [])}
    for container_patch in patch.containers:
        if container_patch.name not in containers:
            raise ValueError(f"containers: the pod has no container {container_patch.name!r}")
        _merge_container(containers[container_patch.name], container_patch)
    return spec


def deprecation_condition(spec: Any) -> dict[str, Any]:
    """The `DeprecatedFields` condition: True (a warning, nothing is refused) while the spec uses
    the shared placement fields the role templates replace."""
    used = [
        name
        for name, value in (("nodeSelector", spec.node_selector), ("tolerations", spec.tolerations))
        if value
    ]
    if not used:
        return {
            "type": "DeprecatedFields",
            "status": "False",
            "reason": "NoneUsed",
            "message": "no deprecated field is used",
        }
    return {
        "type": "DeprecatedFields",
        "status": "True",
        "reason": "SharedPlacement",
        "message": f"{' and '.join('spec.' + name for name in used)} are deprecated and go in the next API "
        "version: spec.nodeSelector now places worker pods only (launchers and frontends need no GPU node), "
        "tolerations apply to every pod; move them to spec.workers.template.spec and to the other roles' "
        "template.spec",
    }
