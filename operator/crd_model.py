"""The `LLMDeployment` spec as the operator reads it: typed, defaulted, validated.

The CRD's OpenAPI schema (`crds/llmdeployment.yaml`) is the source of truth and the API server
applies its defaults and rules before the operator sees an object. This model repeats the
defaults and the cross-field rules for two reasons: an object that reached the operator without
them (an API server without the CRD's validation, an emulator in tests, an older CRD) still gets
a clear error instead of a half-built world, and the rendering code gets typed fields instead of
`dict.get` chains. `tests/operator/test_crd_model.py` checks that both agree.
"""

from __future__ import annotations

import re
import zoneinfo
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from berth.operator.quantity import canonical_quantity

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
    "served-model-name",
    "attach",
)
MANAGED_FLAG_PATTERN = r"^--(" + "|".join(MANAGED_FLAGS) + r")(=.*)?$"

# Kubernetes' own quantity grammar (k8s.io/apimachinery resource.Quantity).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
GPU_RESOURCE = "nvidia.com/gpu"


class _Model(BaseModel):
    # Unknown fields are ignored, not rejected: the API server prunes them anyway, and an
    # operator older than its CRD must keep running objects that use a newer field.
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


class _CamelModel(_Model):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True, alias_generator=_camel)


class PVCSource(_CamelModel):
    claim_name: str = Field(min_length=1)
    read_only: bool = True


class HostPathSource(_CamelModel):
    path: str = Field(pattern=r"^/")


class NFSSource(_CamelModel):
    server: str = Field(min_length=1)
    path: str = Field(pattern=r"^/")


class ModelVolume(_CamelModel):
    mount_path: str = Field(pattern=r"^/")
    persistent_volume_claim: PVCSource | None = None
    host_path: HostPathSource | None = None
    nfs: NFSSource | None = None

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


class ModelSpec(_CamelModel):
    path: str = Field(min_length=1)
    name: str | None = Field(default=None, min_length=1, max_length=256)
    # A name for the weights at `path`: changing it rolls the worlds to what is there now.
    revision: str | None = Field(default=None, min_length=1, max_length=253, pattern=r"^\S+$")
    volume: ModelVolume | None = None

    @model_validator(mode="after")
    def _path_under_mount(self) -> ModelSpec:
        if self.volume is not None and not self.path.startswith(self.volume.mount_path):
            raise ValueError("model.path must lie under model.volume.mountPath")
        return self


Quantity = Annotated[str | int | float, Field()]


def _check_quantity(value: str | int | float, where: str) -> None:
    if isinstance(value, bool) or not re.match(QUANTITY_PATTERN, str(value)):
        raise ValueError(f"{where}: {value!r} is not a Kubernetes quantity (e.g. 500m, 2, 16Gi)")


class Resources(_CamelModel):
    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _quantities(self) -> Resources:
        for part in ("requests", "limits"):
            for key, value in getattr(self, part).items():
                _check_quantity(value, f"{part}.{key}")
        return self

    def as_dict(self) -> dict[str, dict[str, str]]:
        # Canonical form (0.5 -> 500m), the one the API server stores: anything else reads back
        # as drift on every reconcile.
        return {
            part: {key: canonical_quantity(value) for key, value in getattr(self, part).items()}
            for part in ("requests", "limits")
            if getattr(self, part)
        }


class EnvVar(_CamelModel):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    value: str = ""


class Toleration(_CamelModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("a toleration with operator Exists must not set value")
        return self

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class SleepSpec(_CamelModel):
    sleeping: bool = False
    level: Literal[1, 2] = 1


class SleepSchedule(_CamelModel):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    cron: str
    timezone: str = "UTC"
    action: Literal["Sleep", "Wake"]
    level: Literal[1, 2] = 1

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


class RolloutSpec(_CamelModel):
    max_unavailable: int = Field(default=1, ge=1)
    drain_timeout_seconds: int = Field(default=300, ge=0)
    in_place_weight_swap: bool = False


class HealthSpec(_CamelModel):
    interval_seconds: int = Field(default=10, ge=1, le=3600)
    timeout_seconds: int = Field(default=5, ge=1, le=3600)
    failure_threshold: int = Field(default=3, ge=1, le=100)
    max_restarts: int = Field(default=5, ge=0, le=1000)
    restart_window_seconds: int = Field(default=3600, ge=1)
    backoff_seconds: int = Field(default=10, ge=0, le=3600)
    max_backoff_seconds: int = Field(default=300, ge=0, le=86400)
    startup_timeout_seconds: int = Field(default=600, ge=5, le=86400)

    @model_validator(mode="after")
    def _consistent(self) -> HealthSpec:
        if self.timeout_seconds > self.interval_seconds:
            raise ValueError("health.timeoutSeconds must not exceed health.intervalSeconds")
        if self.max_backoff_seconds < self.backoff_seconds:
            raise ValueError("health.maxBackoffSeconds must be at least health.backoffSeconds")
        return self


class ServiceSpec(_CamelModel):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(default=8000, ge=1, le=65535)
    annotations: dict[str, str] = Field(default_factory=dict)


class LLMDeploymentSpec(_CamelModel):
    model: ModelSpec
    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    replicas: int = Field(default=1, ge=0, le=1000)
    tensor_parallel_size: int = Field(default=1, ge=1, le=1024)
    gpus_per_node: int = Field(default=1, ge=0, le=64)
    frontends: int = Field(default=0, ge=0, le=100)
    engine_args: tuple[str, ...] = ()
    env: tuple[EnvVar, ...] = ()
    resources: Resources = Field(default_factory=Resources)
    launcher_resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    sleep: SleepSpec = Field(default_factory=SleepSpec)
    sleep_schedules: tuple[SleepSchedule, ...] = ()
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)

    @model_validator(mode="after")
    def _cross_field_rules(self) -> LLMDeploymentSpec:
        if self.gpus_per_node and self.tensor_parallel_size % self.gpus_per_node:
            raise ValueError(
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
        names = [schedule.name for schedule in self.sleep_schedules]
        if len(names) != len(set(names)):
            raise ValueError("sleepSchedules names must be unique")
        return self

    @property
    def nodes_per_world(self) -> int:
        """Worker pods in one world: one per node, `gpusPerNode` ranks each (one rank per pod on CPU)."""
        return (
            self.tensor_parallel_size // self.gpus_per_node
            if self.gpus_per_node
            else self.tensor_parallel_size
        )

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
