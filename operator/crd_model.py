"""The `LLMDeployment` spec as the operator reads it: typed, defaulted, validated.

This model is the API: the CRD's schema (`crds/llmdeployment.yaml`) is generated from it by
`berth operator crd` (operator/crd.py), field docstrings becoming descriptions and the CEL rules
(`x-kubernetes-validations`) attached to the models they check. The API server applies the
defaults and rules before the operator sees an object; the validators here repeat the rules in
Python so that an object that reached the operator without them (an API server without the CRD,
an older CRD) still gets a clear error instead of a half-built world, and the rendering code gets
typed fields instead of `dict.get` chains.
"""

from __future__ import annotations

import re
import zoneinfo
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from berth.operator.pod_template import RESERVED_ENV, PodTemplate, template_problems
from berth.operator.quantity import Quantity, canonical_quantity, check_quantity

GROUP = "berth.dev"
VERSION = "v1alpha1"
PLURAL = "llmdeployments"
KIND = "LLMDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

# The flags `berth launch` gets from the spec's own fields; letting engineArgs set them too
# would make the pod's command disagree with the objects the operator builds around it.
MANAGED_FLAGS = (
    "hostfile",
    "tensor-parallel-size",
    "gpus-per-node",
    "host",
    "port",
    "admin-port",
    "served-model-name",
    "attach",
    "role",
    "kv-transfer-endpoint",
)
MANAGED_FLAG_PATTERN = r"^--(" + "|".join(MANAGED_FLAGS) + r")(=.*)?$"

GPU_RESOURCE = "nvidia.com/gpu"


def camel_case(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


class _Model(BaseModel):
    # Unknown fields are ignored, not rejected: the API server prunes them anyway, and an
    # operator older than its CRD must keep running objects that use a newer field.
    # Attribute docstrings are the CRD's descriptions (`berth operator crd` writes them).
    model_config = ConfigDict(
        populate_by_name=True,
        extra="ignore",
        frozen=True,
        alias_generator=camel_case,
        use_attribute_docstrings=True,
    )


def _rules(*rules: dict[str, str]) -> dict[str, Any]:
    """The CRD's CEL rules for a model or field (`x-kubernetes-validations`); the operator's
    validators repeat them in Python for an API server that did not run them."""
    return {"x-kubernetes-validations": list(rules)}


def map_list(*keys: str) -> dict[str, Any]:
    """A list whose items are identified by `keys` (server-side apply merges them by key)."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


class PVCSource(_Model):
    """A PersistentVolumeClaim in the same namespace holding the weights."""

    claim_name: str = Field(min_length=1)
    """Name of the PersistentVolumeClaim."""
    read_only: bool = True
    """Kept for familiarity; the operator always mounts weights read-only."""


class HostPathSource(_Model):
    """A directory on every node (single-node and test clusters)."""

    path: str = Field(pattern=r"^/")
    """Absolute directory path on the node."""


class NFSSource(_Model):
    """An NFS export holding the weights."""

    server: str = Field(min_length=1)
    """NFS server host name or IP."""
    path: str = Field(pattern=r"^/")
    """Exported path on the server."""


class ModelVolume(_Model):
    """Where the weights come from: mounted read-only at mountPath on the launcher and every worker
    pod. Omit it when the image already contains the model."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            {
                "rule": "[has(self.persistentVolumeClaim), has(self.hostPath), has(self.nfs)]"
                ".filter(x, x).size() == 1",
                "message": "model.volume needs exactly one of persistentVolumeClaim, hostPath, nfs",
            }
        )
    )

    mount_path: str = Field(pattern=r"^/")
    """Absolute path the volume is mounted at; model.path must lie under it."""
    persistent_volume_claim: PVCSource | None = None
    """A PersistentVolumeClaim in the same namespace holding the weights. Every launcher and worker
    pod mounts it at once, on many nodes: ReadOnlyMany or ReadWriteMany (a ReadWriteOnce claim
    mounted by several pods is the warning condition ModelVolumeNotShareable)."""
    host_path: HostPathSource | None = None
    """A directory on every node (single-node and test clusters)."""
    nfs: NFSSource | None = None
    """An NFS export holding the weights."""

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelVolume:
        sources = [self.persistent_volume_claim, self.host_path, self.nfs]
        if sum(source is not None for source in sources) != 1:
            raise ValueError("model.volume needs exactly one of persistentVolumeClaim, hostPath, nfs")
        return self

    def volume_source(self) -> dict[str, Any]:
        """The Kubernetes volume source, mounted read-only: a world never writes its weights."""
        if self.persistent_volume_claim is not None:
            return {
                "persistentVolumeClaim": {
                    "claimName": self.persistent_volume_claim.claim_name,
                    "readOnly": True,
                }
            }
        if self.host_path is not None:
            return {"hostPath": {"path": self.host_path.path, "type": "Directory"}}
        assert self.nfs is not None  # the validator guarantees one source
        return {"nfs": {"server": self.nfs.server, "path": self.nfs.path, "readOnly": True}}


class ModelSpec(_Model):
    """The model the engine serves."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            {
                "rule": "!has(self.volume) || self.path.startsWith(self.volume.mountPath)",
                "message": "model.path must lie under model.volume.mountPath",
                "fieldPath": ".path",
            }
        )
    )

    path: str = Field(min_length=1, max_length=4096)
    """Model directory inside the containers (a Hugging Face-style checkpoint: config.json,
    safetensors, tokenizer). Passed to `berth launch` as MODEL."""
    name: str | None = Field(default=None, min_length=1, max_length=256)
    """Name clients use in the OpenAI API's `model` field (--served-model-name). Defaults to the
    engine's choice (the path)."""
    revision: str | None = Field(default=None, min_length=1, max_length=253, pattern=r"^\S+$")
    """A name for the weights at `path` (a date, a commit; --model-revision). Change it when the
    files at the same path changed: the worlds roll to them (swapped in place with
    rollout.inPlaceWeightSwap), and each world's modelRevisionLabel says which name its engine
    serves."""
    volume: ModelVolume | None = None
    """Where the weights come from: mounted read-only at mountPath on the launcher and every worker
    pod. Omit it when the image already contains the model."""

    @model_validator(mode="after")
    def _path_under_mount(self) -> ModelSpec:
        if self.volume is not None and not self.path.startswith(self.volume.mount_path):
            raise ValueError("model.path must lie under model.volume.mountPath")
        return self


class Resources(_Model):
    """CPU / memory requests and limits."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Minimum resources (name to quantity, e.g. cpu 4, memory 64Gi)."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum resources (name to quantity)."""

    @model_validator(mode="after")
    def _quantities(self) -> Resources:
        for part in ("requests", "limits"):
            for key, value in getattr(self, part).items():
                check_quantity(value, f"{part}.{key}")
        return self

    def as_dict(self) -> dict[str, dict[str, str]]:
        # Canonical form (0.5 -> 500m), the one the API server stores: anything else reads back
        # as drift on every reconcile.
        return {
            part: {key: canonical_quantity(value) for key, value in getattr(self, part).items()}
            for part in ("requests", "limits")
            if getattr(self, part)
        }


class KeyReference(_Model):
    """One key of a Secret or ConfigMap in the LLMDeployment's namespace."""

    name: str = Field(min_length=1)
    """The Secret's or ConfigMap's name."""
    key: str = Field(min_length=1)
    """The key whose value the variable takes."""
    optional: bool | None = None
    """Start the pod without the variable when the object or key is missing (default: the pod
    waits for it)."""

    def as_dict(self) -> dict[str, Any]:
        # `optional` only when set: the API server stores it the same way (a pointer, omitempty).
        reference: dict[str, Any] = {"name": self.name, "key": self.key}
        if self.optional is not None:
            reference["optional"] = self.optional
        return reference


class EnvVarSource(_Model):
    """Where a variable's value comes from: a Secret's key (API keys, tokens) or a ConfigMap's.
    The value never enters the LLMDeployment, so the object can live in Git."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            {
                "rule": "has(self.secretKeyRef) != has(self.configMapKeyRef)",
                "message": "valueFrom takes exactly one of secretKeyRef and configMapKeyRef",
            }
        )
    )

    secret_key_ref: KeyReference | None = None
    """A key of a Secret."""
    config_map_key_ref: KeyReference | None = None
    """A key of a ConfigMap."""

    @model_validator(mode="after")
    def _one_source(self) -> EnvVarSource:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise ValueError("valueFrom takes exactly one of secretKeyRef and configMapKeyRef")
        return self

    def as_dict(self) -> dict[str, Any]:
        if self.secret_key_ref is not None:
            return {"secretKeyRef": self.secret_key_ref.as_dict()}
        assert self.config_map_key_ref is not None
        return {"configMapKeyRef": self.config_map_key_ref.as_dict()}


class EnvVar(_Model):
    """One environment variable: a literal value, or valueFrom a Secret's or ConfigMap's key."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            {
                "rule": "!(has(self.value) && self.value != '' && has(self.valueFrom))",
                "message": "an env variable takes value or valueFrom, not both",
            },
            {
                "rule": f"!(self.name in {sorted(RESERVED_ENV)})",
                "message": f"env may not set {', '.join(sorted(RESERVED_ENV))}: berth sets them "
                "(its own Secrets)",
            },
        )
    )

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Variable name."""
    value: str = ""
    """Variable value (in the LLMDeployment, so in Git: put secrets in valueFrom)."""
    value_from: EnvVarSource | None = None
    """Take the value from a Secret's or ConfigMap's key at the pod's start."""

    @model_validator(mode="after")
    def _value_or_source(self) -> EnvVar:
        if self.value and self.value_from is not None:
            raise ValueError(f"env {self.name}: value and valueFrom are exclusive")
        if self.name in RESERVED_ENV:
            raise ValueError(f"env may not set {self.name}: berth sets it (its own Secrets)")
        return self

    def as_dict(self) -> dict[str, Any]:
        # An empty value is rendered without `value`, as the API server stores it (`omitempty`):
        # otherwise every read would differ from the rendering and be "repaired" forever.
        if self.value_from is not None:
            return {"name": self.name, "valueFrom": self.value_from.as_dict()}
        return {"name": self.name, "value": self.value} if self.value else {"name": self.name}


class Toleration(_Model):
    """A Kubernetes toleration."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            {
                "rule": "self.operator != 'Exists' || !has(self.value)",
                "message": "a toleration with operator Exists must not set value",
            }
        )
    )

    key: str | None = None
    """Taint key; empty with operator Exists matches every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Exists or Equal."""
    value: str | None = None
    """Taint value (operator Equal)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all."""
    toleration_seconds: int | None = None
    """How long a NoExecute taint is tolerated."""

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("a toleration with operator Exists must not set value")
        return self

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class SleepSpec(_Model):
    """Manual sleep switch. Sleep parks the engine (admission stops, in-flight requests drain) and
    frees device memory; the pods keep their GPUs allocated."""

    sleeping: bool = False
    """true parks every world; false wakes them."""
    level: Literal[1, 2] = 1
    """1 offloads weights to host memory; 2 drops them (reloaded on wakeup)."""


CRON_PATTERN = r"^(@(yearly|annually|monthly|weekly|daily|midnight|hourly)|((\S+\s+){4}\S+))$"
TIMEZONE_PATTERN = r"^[A-Za-z][A-Za-z0-9_+\-]*(/[A-Za-z0-9_+\-]+)*$"


class SleepSchedule(_Model):
    """One schedule."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    """Unique name of the schedule (a DNS label)."""
    # The CRD can only check the shape; croniter and zoneinfo check the meaning.
    cron: str = Field(json_schema_extra={"pattern": CRON_PATTERN})
    """Five-field cron expression (minute hour day month weekday) or @daily-style macro."""
    timezone: str = Field(default="UTC", json_schema_extra={"pattern": TIMEZONE_PATTERN})
    """IANA time zone the cron expression is read in."""
    action: Literal["Sleep", "Wake"]
    """What happens at each firing."""
    level: Literal[1, 2] = 1
    """Sleep level for action Sleep."""

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str) -> str:
        from croniter import croniter

        if not croniter.is_valid(value):
            raise ValueError(f"{value!r} is not a cron expression (five fields, e.g. '0 22 * * 1-5')")
        return value

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        try:
            zoneinfo.ZoneInfo(value)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{value!r} is not an IANA time zone (e.g. Europe/Berlin, UTC)") from None
        return value


class RolloutSpec(_Model):
    """How spec changes (image, model, engine arguments) are rolled out."""

    max_unavailable: int = Field(default=1, ge=1)
    """Worlds that may be out of service at once during a rollout."""
    drain_timeout_seconds: int = Field(default=300, ge=0)
    """How long in-flight requests may finish before a world is replaced, and after a launcher or
    frontend pod is stopped (its termination grace period is this plus 30 s)."""
    in_place_weight_swap: bool = False
    """When only the model changes, swap weights through sleep level 2 + wakeup, no pod restart."""


class HealthSpec(_Model):
    """How the operator watches worlds and restarts dead ones."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            {
                "rule": "self.timeoutSeconds <= self.intervalSeconds",
                "message": "health.timeoutSeconds must not exceed health.intervalSeconds",
            },
            {
                "rule": "self.maxBackoffSeconds >= self.backoffSeconds",
                "message": "health.maxBackoffSeconds must be at least health.backoffSeconds",
            },
        )
    )

    interval_seconds: int = Field(default=10, ge=1, le=3600)
    """Seconds between two health polls of each launcher (/health, /ready)."""
    timeout_seconds: int = Field(default=5, ge=1, le=3600)
    """Timeout of one health request."""
    failure_threshold: int = Field(default=3, ge=1, le=100)
    """Consecutive unanswered polls after which a world counts as dead."""
    max_restarts: int = Field(default=5, ge=0, le=1000)
    """Whole-world restarts allowed within restartWindowSeconds; then Degraded."""
    restart_window_seconds: int = Field(default=3600, ge=1)
    """Sliding window the restart budget counts in."""
    backoff_seconds: int = Field(default=10, ge=0, le=3600)
    """Delay before the second restart in the window; doubles for each further one."""
    max_backoff_seconds: int = Field(default=300, ge=0, le=86400)
    """Upper bound of the restart delay."""
    startup_timeout_seconds: int = Field(default=600, ge=5, le=86400)
    """How long the engine may take to load the model before the kubelet's liveness probe counts
    (the launcher's and frontends' startup probe). Raise it for large models on slow volumes."""

    @model_validator(mode="after")
    def _consistent(self) -> HealthSpec:
        if self.timeout_seconds > self.interval_seconds:
            raise ValueError("health.timeoutSeconds must not exceed health.intervalSeconds")
        if self.max_backoff_seconds < self.backoff_seconds:
            raise ValueError("health.maxBackoffSeconds must be at least health.backoffSeconds")
        return self


class ServiceSpec(_Model):
    """The Service that is the deployment's OpenAI endpoint."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Kubernetes Service type."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Service port (the pods listen on 8000)."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations for the Service (e.g. for a load balancer)."""


STABILIZATION = (
    "The recommendations of this many past seconds are considered: a scale-up goes only as high "
    "as the lowest of them, a scale-down only as low as the highest (a load that oscillates "
    "around the target moves nothing)."
)


class ScaleUpRules(_Model):
    """How fast autoscaling adds worlds (HorizontalPodAutoscaler's behavior.scaleUp)."""

    stabilization_window_seconds: int = Field(default=0, ge=0, le=3600, description=STABILIZATION)


class ScaleDownRules(_Model):
    """How fast autoscaling removes worlds (HorizontalPodAutoscaler's behavior.scaleDown)."""

    stabilization_window_seconds: int = Field(default=300, ge=0, le=3600, description=STABILIZATION)


class IdleSpec(_Model):
    """Scale to zero in two tiers: asleep after a while without requests (woken in seconds, pods
    kept), then released (pods deleted, GPUs given back)."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            {
                "rule": "!has(self.releaseAfterSeconds) || has(self.sleepAfterSeconds)",
                "message": "idle.releaseAfterSeconds counts from the idle sleep: "
                "set idle.sleepAfterSeconds too",
            }
        )
    )

    sleep_after_seconds: int | None = Field(default=None, ge=1, le=86400 * 7)
    """Seconds without a request after which the worlds beyond minAwake are put to sleep. Unset:
    idle worlds stay awake."""
    min_awake: int = Field(default=1, ge=0, le=1000)
    """Worlds kept awake however idle the deployment is (0: every world may sleep)."""
    level: Literal[1, 2] = 1
    """Sleep level of an idle world (1 keeps the weights in host memory, 2 drops them)."""
    release_after_seconds: int | None = Field(default=None, ge=1, le=86400 * 30)
    """Seconds asleep after which the worlds beyond minWorlds are deleted (their GPUs released).
    Unset: asleep worlds are kept."""
    min_worlds: int = Field(default=0, ge=0, le=1000)
    """Worlds never released, asleep or awake (0: every idle world may be deleted)."""
    wake_timeout_seconds: int = Field(default=300, ge=1, le=3600)
    """With minAwake 0: how long a request that arrives while every world sleeps or is released
    is held (by the deployment's activator pod) for a world to wake; then 503 + Retry-After."""

    @model_validator(mode="after")
    def _release_needs_sleep(self) -> IdleSpec:
        if self.release_after_seconds is not None and self.sleep_after_seconds is None:
            raise ValueError(
                "idle.releaseAfterSeconds counts from the idle sleep: set idle.sleepAfterSeconds too"
            )
        return self


class AutoscalingSpec(_Model):
    """Worlds follow the engines' load (operator/autoscale.py). `replicas` is the starting point;
    the operator writes the worlds it wants to status.autoscaling, never to the spec."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            {
                "rule": "self.minReplicas <= self.maxReplicas",
                "message": "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
            },
            {
                "rule": "self.metric != 'kvCacheUsage' || double(self.target) <= 1.0",
                "message": "autoscaling.target of kvCacheUsage is a fraction of the KV cache (at most 1)",
            },
        )
    )

    min_replicas: int = Field(default=1, ge=0, le=1000)
    """Fewest worlds load-based scaling keeps (idle may go below it: see idle)."""
    max_replicas: int = Field(ge=1, le=1000)
    """Most worlds load-based scaling starts."""
    metric: Literal["queueDepth", "kvCacheUsage", "runningRequests"] = "queueDepth"
    """queueDepth: requests waiting per serving world; kvCacheUsage: the mean fraction of KV cache
    blocks in use; runningRequests: requests running per serving world. Read from each engine's
    GET /admin/state at every health poll."""
    target: float = Field(gt=0)
    """The metric's target value: worlds = ceil(serving worlds x metric / target)."""
    window_seconds: int = Field(default=30, ge=0, le=3600)
    """The metric is the mean of the polls of this many past seconds (0: the latest poll)."""
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    """No scaling while metric / target stays within 1 +- tolerance."""
    scale_up: ScaleUpRules = Field(default_factory=ScaleUpRules)
    """Scale-up behavior (stabilization 0 s: at once, as an HPA's)."""
    scale_down: ScaleDownRules = Field(default_factory=ScaleDownRules)
    """Scale-down behavior (stabilization 300 s, as an HPA's)."""
    idle: IdleSpec = Field(default_factory=IdleSpec)
    """Scale to zero in two tiers: asleep, then released."""

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.minReplicas must not exceed autoscaling.maxReplicas")
        if self.metric == "kvCacheUsage" and self.target > 1:
            raise ValueError("autoscaling.target of kvCacheUsage is a fraction of the KV cache (at most 1)")
        return self


class NetworkPolicySpec(_Model):
    """The NetworkPolicies rendered with the deployment (operator/README.md, "Network")."""

    enabled: bool = True
    """Render them: clients reach only the OpenAI port, frontends the attach port, the operator
    the admin port, and the pods of one world each other; everything else to the pods is denied.
    False: none (a cluster whose own policies say it)."""


class RoleSpec(_Model):
    """Settings of one role's pods (launcher or frontend)."""

    template: PodTemplate = Field(default_factory=PodTemplate)
    """Pod template merged over what berth renders (containers and volumes by name); berth's
    command, ports, probes and engine environment cannot be overridden."""


class WorkersSpec(RoleSpec):
    """Settings of the worker pods."""

    topology_key: str | None = Field(default=None, min_length=1, max_length=317)
    """Node label (e.g. nvidia.com/gpu.clique, a rack label) whose value all worker pods of one
    world share: a world stays inside one NVLink / InfiniBand domain; worlds spread across domains
    when they can."""


class SchedulingSpec(_Model):
    """How a world's pods are scheduled: all of them or none."""

    gang: Literal["none", "coscheduling", "volcano", "kueue"] = "none"
    """none: berth releases a partly scheduled world itself after timeoutSeconds; coscheduling:
    a scheduler-plugins PodGroup; volcano: a Volcano PodGroup; kueue: Kueue's pod-group labels.
    Set the gang scheduler's schedulerName in the templates (coscheduling, volcano)."""
    timeout_seconds: int = Field(default=300, ge=1, le=86400)
    """How long a world's pods may wait to be scheduled, all of them, before the world is
    released (gang none) or the PodGroup gives up (scheduleTimeoutSeconds)."""
    queue_name: str | None = Field(default=None, min_length=1, max_length=253)
    """Kueue LocalQueue (gang kueue) or Volcano queue (gang volcano)."""


class PoolSpec(_Model):
    """One pool of a disaggregated deployment: its worlds all run one role."""

    replicas: int = Field(default=1, ge=1, le=500)
    """Worlds in the pool."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=1024)
    """Ranks in one world of the pool; the deployment's `gpusPerNode` applies. The pools may
    differ: a generation world reshards the KV cache it pulls to its own ranks."""


class RouterSpec(_Model):
    """The router of a disaggregated deployment: stateless, so its pods are interchangeable."""

    replicas: int = Field(default=1, ge=1, le=100)
    """Router pods behind the Service. With one, a router restart fails the requests in flight
    through it; two keep the endpoint up through a node's loss or a rolled router."""


class DisaggregationSpec(_Model):
    """Disaggregated prefill and decode: context worlds run prompts (`berth launch --role
    context`), generation worlds continue from their KV cache (`--role generation`), and a router
    (`berth serve --route`) is the endpoint Service's only member."""

    context: PoolSpec = Field(default_factory=PoolSpec)
    """The worlds that run prompts: worlds 0 .. context.replicas - 1."""
    generation: PoolSpec = Field(default_factory=PoolSpec)
    """The worlds that generate from the context worlds' KV cache: the worlds after them."""
    router: RouterSpec = Field(default_factory=RouterSpec)
    """The router's pods (`berth serve --route`)."""

    @property
    def worlds(self) -> int:
        return self.context.replicas + self.generation.replicas


_DISAGGREGATED = "!has(self.disaggregation) || "
POOL_SIZE_MESSAGE = (
    "tensorParallelSize: not with disaggregation (each pool has its own: "
    "disaggregation.POOL.tensorParallelSize)"
)
DISAGGREGATION_RULES = (
    {
        "rule": _DISAGGREGATED + "self.replicas == 1 || self.replicas == "
        "(has(self.disaggregation.context) ? self.disaggregation.context.replicas : 1) + "
        "(has(self.disaggregation.generation) ? self.disaggregation.generation.replicas : 1)",
        "message": "replicas conflicts with disaggregation: the worlds are the pools' (leave replicas "
        "unset and scale each pool through disaggregation.POOL.replicas)",
        "fieldPath": ".replicas",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": _DISAGGREGATED + "self.tensorParallelSize == 1",
        "message": POOL_SIZE_MESSAGE,
        "fieldPath": ".tensorParallelSize",
        "reason": "FieldValueForbidden",
    },
    {
        "rule": _DISAGGREGATED
        + "self.gpusPerNode == 0 || ["
        + ", ".join(
            f"has(self.disaggregation.{pool}) ? self.disaggregation.{pool}.tensorParallelSize : 1"
            for pool in ("context", "generation")
        )
        + "].all(size, size % self.gpusPerNode == 0)",
        "message": "disaggregation.POOL.tensorParallelSize must be a multiple of gpusPerNode (a world is "
        "tensorParallelSize / gpusPerNode worker pods with gpusPerNode GPUs each)",
        "fieldPath": ".disaggregation",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": _DISAGGREGATED + "self.frontends == 0",
        "message": "frontends: not with disaggregation (the router is the endpoint)",
        "fieldPath": ".frontends",
        "reason": "FieldValueForbidden",
    },
    {
        "rule": _DISAGGREGATED + "!has(self.autoscaling)",
        "message": "autoscaling: not with disaggregation yet (scale each pool through "
        "disaggregation.POOL.replicas)",
        "fieldPath": ".autoscaling",
        "reason": "FieldValueForbidden",
    },
)


def disaggregation_problems(spec: LLMDeploymentSpec) -> list[str]:
    """What spec.disaggregation cannot be combined with (the CRD's rules say the same)."""
    pools = spec.disaggregation
    problems = []
    if spec.replicas not in (1, pools.worlds):
        problems.append(
            f"replicas ({spec.replicas}) conflicts with disaggregation: the worlds are the pools' "
            f"({pools.context.replicas} context + {pools.generation.replicas} generation); leave replicas "
            "unset and scale each pool through disaggregation.POOL.replicas"
        )
    if spec.tensor_parallel_size != 1:
        problems.append(POOL_SIZE_MESSAGE)
    if spec.frontends:
        problems.append(
            "frontends: not with disaggregation (the router is the endpoint; "
            "attach frontends would bypass it)"
        )
    if spec.autoscaling is not None:
        problems.append(
            "autoscaling: not with disaggregation yet (scale each pool through disaggregation.POOL.replicas)"
        )
    return problems


ENGINE_ARGS_RULE = {
    "rule": "self.all(a, !a.matches('^--(" + "|".join(MANAGED_FLAGS) + ")(=.*)?$'))",
    "message": "engineArgs must not set "
    + ", ".join(f"--{flag}" for flag in MANAGED_FLAGS[:-1])
    + f" or --{MANAGED_FLAGS[-1]}: the operator sets them from the spec",
}


class LLMDeploymentSpec(_Model):
    """Desired state. The operator never writes it (GitOps-safe); it writes only status."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            {
                "rule": "self.gpusPerNode == 0 || self.tensorParallelSize % self.gpusPerNode == 0",
                "message": "tensorParallelSize must be a multiple of gpusPerNode (a world is "
                "tensorParallelSize / gpusPerNode worker pods with gpusPerNode GPUs each)",
                "fieldPath": ".tensorParallelSize",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": "!has(self.resources) || "
                "((!has(self.resources.requests) || !('nvidia.com/gpu' in self.resources.requests)) && "
                "(!has(self.resources.limits) || !('nvidia.com/gpu' in self.resources.limits)))",
                "message": "do not set nvidia.com/gpu in resources: "
                "the operator requests gpusPerNode GPUs per worker pod",
                "fieldPath": ".resources",
                "reason": "FieldValueForbidden",
            },
            *DISAGGREGATION_RULES,
        )
    )

    model: ModelSpec
    """The model the engine serves."""
    image: str = Field(min_length=1)
    """Container image with the `berth` command, MPI, and an SSH server (/usr/sbin/sshd) for the
    worker pods; used by launcher, worker and frontend pods."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Image pull policy of every pod the operator creates."""
    replicas: int = Field(default=1, ge=0, le=1000)
    """Number of engine worlds (independent copies of the model). Scale subresource."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=1024)
    """Ranks in one world (tensor parallelism). Must be a multiple of gpusPerNode."""
    gpus_per_node: int = Field(default=1, ge=0, le=64)
    """GPUs (nvidia.com/gpu) each worker pod requests; a world has tensorParallelSize / gpusPerNode
    worker pods. 0 runs CPU-only worker pods, one rank each."""
    frontends: int = Field(default=0, ge=0, le=100)
    """Extra attach-frontend pods per world (`berth serve --attach`): more HTTP, tokenization and
    streaming capacity sharing one engine."""
    engine_args: tuple[Annotated[str, Field(max_length=1024, description="One argument.")], ...] = Field(
        default=(), max_length=128, json_schema_extra=_rules(ENGINE_ARGS_RULE)
    )
    """Extra command-line arguments appended to `berth launch` (e.g. "--max-num-seqs=64"). Flags
    the operator derives from the spec are refused."""
    env: tuple[EnvVar, ...] = Field(default=(), max_length=64, json_schema_extra=map_list("name"))
    """Extra environment variables for launcher, worker and frontend containers."""
    resources: Resources = Field(default_factory=Resources)
    """CPU / memory requests and limits of each worker pod. GPUs come from gpusPerNode and must not
    be set here."""
    launcher_resources: Resources = Field(default_factory=Resources)
    """CPU / memory requests and limits of launcher and frontend pods (no GPUs)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Deprecated: node labels the worker pods must match (launchers and frontends no longer
    inherit it); use workers.template.spec.nodeSelector."""
    tolerations: tuple[Toleration, ...] = ()
    """Deprecated: tolerations of every pod; use the roles' template.spec.tolerations."""
    launcher: RoleSpec = Field(default_factory=RoleSpec)
    """The launcher pods (`berth launch`: mpirun, the engine's proxy, the OpenAI server)."""
    workers: WorkersSpec = Field(default_factory=WorkersSpec)
    """The worker pods (sshd; gpusPerNode ranks each)."""
    frontend: RoleSpec = Field(default_factory=RoleSpec)
    """The attach-frontend pods (`berth serve --attach`; spec.frontends of them per world)."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """Gang scheduling: a world's pods are scheduled all together or not at all."""
    sleep: SleepSpec = Field(default_factory=SleepSpec)
    """Manual sleep switch. Sleep parks the engine (admission stops, in-flight requests drain) and
    frees device memory; the pods keep their GPUs allocated."""
    sleep_schedules: tuple[SleepSchedule, ...] = Field(
        default=(), max_length=32, json_schema_extra=map_list("name")
    )
    """Cron schedules that sleep or wake every world."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """How spec changes (image, model, engine arguments) are rolled out."""
    health: HealthSpec = Field(default_factory=HealthSpec)
    """How the operator watches worlds and restarts dead ones."""
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    """The Service that is the deployment's OpenAI endpoint."""
    autoscaling: AutoscalingSpec | None = None
    """Scale the worlds on the engines' load, and to zero when idle (asleep, then released).
    Unset: `replicas` worlds, changed only through the spec or the scale subresource."""
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    """Ingress rules for the deployment's pods (on by default)."""
    disaggregation: DisaggregationSpec | None = None
    """Disaggregated prefill and decode: a pool of context worlds, a pool of generation worlds
    and a router in front of them. The worlds are the pools' (replicas is their sum: leave it
    unset), and each pool sizes its worlds (leave tensorParallelSize unset); not with frontends
    or autoscaling."""

    @model_validator(mode="after")
    def _cross_field_rules(self) -> LLMDeploymentSpec:
        if self.disaggregation is not None:
            problems = disaggregation_problems(self)
            if problems:
                raise ValueError("; ".join(problems))
            # The worlds are the pools' (context first): everything that counts worlds (the
            # reconcile, health rounds, rollouts, scale-down) counts them through replicas, and
            # sizes each one through ranks_of.
            object.__setattr__(self, "replicas", self.disaggregation.worlds)
        if self.gpus_per_node and any(
            self.ranks_of(world) % self.gpus_per_node for world in range(self.replicas)
        ):
            raise ValueError(
                f"{'disaggregation.POOL.' if self.disaggregation else ''}"
                "tensorParallelSize must be a multiple of gpusPerNode (a world is "
                "tensorParallelSize / gpusPerNode worker pods with gpusPerNode GPUs each)"
            )
        for part in (self.resources.requests, self.resources.limits):
            if GPU_RESOURCE in part:
                raise ValueError(
                    "do not set nvidia.com/gpu in resources: "
                    "the operator requests gpusPerNode GPUs per worker pod"
                )
        for arg in self.engine_args:
            if re.match(MANAGED_FLAG_PATTERN, arg):
                raise ValueError(
                    f"engineArgs must not set {arg.split('=')[0]}: the operator sets it from the spec"
                )
        model_mount = [self.model.volume.mount_path] if self.model.volume else []
        problems = [
            problem
            for role, settings in (
                ("launcher", self.launcher),
                ("worker", self.workers),
                ("frontend", self.frontend),
            )
            for problem in template_problems(role, settings.template, model_mount)
        ]
        if problems:
            raise ValueError("; ".join(problems))
        names = [schedule.name for schedule in self.sleep_schedules]
        if len(names) != len(set(names)):
            raise ValueError("sleepSchedules names must be unique")
        return self

    def pool_of(self, world: int) -> str | None:
        """'context' or 'generation' for a world of a disaggregated deployment, else None."""
        if self.disaggregation is None:
            return None
        return "context" if world < self.disaggregation.context.replicas else "generation"

    def ranks_of(self, world: int) -> int:
        """Ranks in a world: tensorParallelSize, or its pool's with spec.disaggregation."""
        if self.disaggregation is None:
            return self.tensor_parallel_size
        return getattr(self.disaggregation, self.pool_of(world)).tensor_parallel_size

    def nodes_of(self, world: int) -> int:
        """Worker pods in a world: one per node, `gpusPerNode` ranks each (one rank per pod on CPU)."""
        ranks = self.ranks_of(world)
        return ranks // self.gpus_per_node if self.gpus_per_node else ranks

    @property
    def scales_to_zero(self) -> bool:
        """Every world may sleep or be released for idleness: an activator holds the requests."""
        return self.autoscaling is not None and self.autoscaling.idle.min_awake == 0

    @property
    def served_model_name(self) -> str | None:
        return self.model.name


class InvalidSpec(ValueError):
    """A spec the operator cannot build a world from; the message names the field."""


# The name is a Service's name (a DNS-1035 label) and the prefix of every child's. The longest
# child name that must fit a label value is a StatefulSet's pod label controller-revision-hash:
# NAME-wI (up to NAME-w999, 5 more characters) plus an 11-character hash, at most 63 in all.
MAX_NAME_LENGTH = 63 - 11 - len("-w999")
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


def name_problems(name: str) -> list[str]:
    """Why an LLMDeployment of this name can never be deployed (the CRD refuses it too)."""
    problems = []
    if len(name) > MAX_NAME_LENGTH:
        problems.append(
            f"metadata.name must be at most {MAX_NAME_LENGTH} characters (it has {len(name)}): the operator "
            "names children NAME-wI (up to NAME-w999), and a StatefulSet's pods carry its name plus an "
            "11-character hash in a label of at most 63 characters"
        )
    if not re.match(NAME_PATTERN, name):
        problems.append(
            f"metadata.name {name!r} must be a DNS-1035 label (lower case letters, digits and '-', "
            "starting with a letter): it is the name of the deployment's Service"
        )
    return problems


def parse_spec(spec: Any, name: str | None = None) -> LLMDeploymentSpec:
    """Validate a raw `spec` mapping (and the object's name, when given); raise `InvalidSpec`
    with every problem, field by field."""
    problems = name_problems(name) if name is not None else []
    try:
        parsed = LLMDeploymentSpec.model_validate(dict(spec or {}))
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"])
            message = error["msg"].removeprefix("Value error, ")
            problems.append(f"spec.{where}: {message}" if where else f"spec: {message}")
    if problems:
        raise InvalidSpec("; ".join(problems))
    return parsed
