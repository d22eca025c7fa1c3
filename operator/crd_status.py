"""The `LLMDeployment` status as the operator writes it: the status half of the CRD's schema.

A real API server prunes every status field its schema does not declare, silently: a field the
operator writes but this model lacks is lost on the first write and only the operator's memory
kept it (an operator restart forgets it). `berth operator crd` generates the schema from these
classes, so what the operator writes and what the server keeps cannot drift apart; the test
emulator prunes like a server and fails any test whose writes lose a field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from berth.operator.crd_model import camel_case, map_list

Time = Annotated[str, Field(description="RFC 3339 time.")]
PodUID = Annotated[str, Field(description="A pod UID.")]
WorldIndex = Annotated[int, Field(description="A world's index.")]
NodeName = Annotated[str, Field(description="A node's name.")]

# Fields whose content has its own shape outside this model (kopf's bookkeeping).
PRESERVE_UNKNOWN = {"x-kubernetes-preserve-unknown-fields": True}


class _Status(BaseModel):
    # `forbid`: a key the operator writes must be declared here, or the server would drop it.
    model_config = ConfigDict(
        populate_by_name=True, extra="forbid", alias_generator=camel_case, use_attribute_docstrings=True
    )


class Condition(_Status):
    """A condition, shaped like metav1.Condition."""

    type: str
    """Condition type."""
    status: Literal["True", "False", "Unknown"]
    """Condition status."""
    reason: str | None = None
    """CamelCase reason, stable for automation."""
    message: str | None = None
    """What is going on and what to do about it."""
    last_transition_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    """When status last changed."""
    observed_generation: int | None = None
    """metadata.generation the condition was computed for."""


class NextTransition(_Status):
    """The next scheduled sleep or wake (from spec.sleepSchedules)."""

    time: str | None = None
    """When it fires (RFC 3339, UTC)."""
    schedule: str | None = None
    """The schedule's name."""
    action: str | None = None
    """Sleep or Wake."""
    level: int | None = None
    """Sleep level for Sleep."""
    held_by: str | None = None
    """Set (spec.sleep) while the manual switch overrides the schedules."""
    message: str | None = None
    """The same, in words."""


class Refusal(_Status):
    """Set while the operator refuses the current spec (why, and for which generation)."""

    generation: int | None = None
    """metadata.generation of the refused spec."""
    message: str | None = None
    """Why it cannot be deployed."""


class RecentRestart(_Status):
    """One whole-world restart."""

    time: str | None = None
    """RFC 3339 time of the restart."""
    reason: str | None = None
    """As lastRestartReason."""
    error: str | None = None
    """The last line of the error (a traceback ends with the exception)."""
    node: str | None = Field(default=None, json_schema_extra={"nullable": True})
    """The node of the pod at fault (the launcher's for an engine failure)."""


class LastTransition(_Status):
    """The last sleep, wakeup or weight swap the operator asked this engine for."""

    kind: str | None = None
    """sleep, wakeup or swap."""
    purpose: str | None = None
    """Why (sleep, wake, retire, rollout, swap)."""
    result: str | None = None
    """done, refused, dead, unreachable or failed."""
    message: str | None = None
    """What the engine answered."""
    time: str | None = None
    """When it ended."""


class ApiError(_Status):
    """A write to a child that the API server refused (admission, quota, validation): the operator
    retries it with backoff and keeps supervising the other worlds meanwhile."""

    object: str
    """Kind/name of the child."""
    verb: str | None = None
    """The request refused: create, apply, delete."""
    code: int | None = None
    """HTTP status (403 Forbidden, 422 Invalid, ...)."""
    message: str | None = None
    """The API server's message, verbatim."""
    time: str | None = None
    """When it was refused first (RFC 3339)."""
    last_time: str | None = None
    """When it was refused last."""
    retries: int | None = None
    """Refusals so far."""
    next_retry: str | None = None
    """When the operator tries again."""


class Conflict(_Status):
    """An object with a child's name that this LLMDeployment does not control. The operator never
    patches, deletes, mounts or reads it; rename or delete it (or the LLMDeployment) to resolve."""

    kind: str
    """Its kind."""
    name: str
    """Its name."""
    owner: str | None = None
    """Who controls it ("nobody" or Kind/name of its controller)."""
    world: int | None = None
    """The world that needs it (absent: the whole deployment needs it)."""


class WorldScheduling(_Status):
    """Whether all of a world's pods got nodes (operator/gang.py)."""

    waiting_since: str | None = None
    """Since when some pod of the world waits for a node."""
    message: str | None = None
    """Which pods wait, in the scheduler's words (e.g. 0/3 nodes are available: ...)."""
    attempts: int | None = None
    """Times the world was released for lack of room (not restarts: no restart budget spent)."""
    retry_at: str | None = None
    """When a released world tries to be scheduled again (back-off with jitter)."""


class WorldStatus(_Status):
    """The state of one world."""

    index: int
    """World number (0-based); part of its children's names."""
    phase: str | None = None
    """Pending, Starting, Ready, NotReady, Sleeping, Waking, Unreachable, Restarting, BackingOff,
    Failed, Blocked (a child conflicts or is refused), Unschedulable (not all its pods found
    nodes in time: released, holding none, until scheduling.retryAt), Evicting (parked, its pods
    evicted by a node drain, then replaced on other nodes: no restart counted), or Retiring
    (beyond replicas: draining before removal)."""
    message: str | None = None
    """Why the world is in its phase."""
    ready: bool | None = None
    """The engine answers /ready with 200."""
    admission: str | None = None
    """Engine admission state (running, parking, parked, waking, failed)."""
    launcher_pod: str | None = None
    """Name of the world's launcher pod."""
    pool: str | None = None
    """With spec.disaggregation: context or generation, the pool the world belongs to."""
    restarts: int | None = None
    """Whole-world restarts so far."""
    restart_times: list[Time] | None = None
    """Times of the restarts inside the restart window (the budget's memory)."""
    last_restart_time: str | None = None
    """When the world was last restarted."""
    last_restart_reason: str | None = None
    """EngineDead, Stalled (alive, no step within its stall timeout), OOMKilled (a pod the kernel's
    OOM killer ended), LauncherFailed, LauncherExited, LauncherGone, WorkerFailed, WorkerRestarted
    or Unreachable."""
    recent_restarts: list[RecentRestart] | None = None
    """The last 5 restarts, newest last (Events and the restarts metric keep the rest)."""
    last_engine_error: str | None = None
    """The engine's own error text from its last death."""
    last_error_time: str | None = None
    """When that error was seen."""
    probe_failures: int | None = None
    """Consecutive unanswered health polls."""
    replaced_pods: list[PodUID] | None = None
    """UIDs of the pods the last restart deletes (recorded before they are deleted, so an
    interrupted restart is finished, not counted twice)."""
    members: dict[str, str] | None = None
    """Pod name to "uid/restartCount" of the world's pods when it came up."""
    model_revision: str | None = None
    """Model revision the engine reports (PATH@DIGEST, from /admin/state)."""
    model_revision_label: str | None = None
    """The name (spec.model.revision) the engine's weights were loaded under."""
    sleep_level: int | None = None
    """The engine's sleep level (0 awake, 1 or 2)."""
    last_transition: LastTransition | None = None
    """The last sleep, wakeup or weight swap the operator asked this engine for."""
    api_errors: list[ApiError] | None = None
    """Writes to this world's children the API server refuses, retried with backoff."""
    tier: Literal["awake", "asleep"] | None = None
    """With spec.autoscaling: awake, or asleep for idleness (released worlds have no entry; see
    status.autoscaling)."""
    scheduling: WorldScheduling | None = None
    """Its pods' scheduling, while some wait for nodes or the world was released for lack of room."""


class RolloutStep(_Status):
    """A world the rollout has taken out of service, and how far it got."""

    world: int
    """The world."""
    step: Literal["draining", "replacing", "swapping"]
    """draining (sleeping in drain mode), replacing (new pods starting) or swapping (weights
    swapped in place through sleep level 2 and wakeup)."""
    since: str | None = None
    """When the rollout took it (RFC 3339)."""
    draining_since: str | None = None
    """When its drain started."""


class RolloutFailure(_Status):
    """The world that failed the rollout, which stopped there."""

    world: int
    """The world."""
    message: str | None = None
    """Why."""


class RolloutStatus(_Status):
    """The rollout's memory: what an operator restarted at any point resumes from."""

    target: str | None = None
    """Digest of the rendered pod specs the worlds roll to."""
    done: list[WorldIndex] | None = None
    """Worlds on the target and Ready."""
    in_flight: list[RolloutStep] | None = None
    """Worlds out of service for the rollout, and their step."""
    failed: RolloutFailure | None = None
    """Set when a world failed the rollout: no other world is taken until the spec changes."""
    complete: bool | None = None
    """Every world runs the target."""


class DrainStep(_Status):
    """A world moving off nodes being drained (operator/disruption.py)."""

    world: int
    """The world."""
    step: Literal["parking", "evicting"]
    """parking (sleeping in drain mode before its pods may go) or evicting (parked; its pods on
    the drained nodes are out of its PodDisruptionBudget, labelled berth.dev/evictable, and the
    drain evicts them; then the world is replaced on other nodes)."""
    nodes: list[NodeName] | None = None
    """The drained nodes it holds pods on."""
    since: str | None = None
    """When the operator took it (RFC 3339)."""
    evicting_since: str | None = None
    """When its pods were released to the drain."""


class DisruptionStatus(_Status):
    """Node drains: the worlds moving off drained nodes, at most rollout.maxUnavailable out of
    service at a time."""

    in_flight: list[DrainStep] | None = None
    """Worlds taken by a drain, and their step."""


class AutoscalingStatus(_Status):
    """What autoscaling measured and decided (spec.autoscaling): the operator never writes the spec."""

    metric: str | None = None
    """The metric it scales on."""
    current_value: float | None = None
    """The metric's mean over the window (absent while no world serves)."""
    target: float | None = None
    """The metric's target."""
    desired_replicas: int | None = None
    """The worlds the load asks for (within minReplicas and maxReplicas)."""
    worlds: int | None = None
    """The worlds that exist: desiredReplicas, or fewer while idle worlds are released."""
    asleep_worlds: list[WorldIndex] | None = None
    """Worlds asleep because no request came for idle.sleepAfterSeconds."""
    released: bool | None = None
    """True while the worlds beyond idle.minWorlds are released (deleted) for idleness."""
    last_scale_time: str | None = None
    """When it last changed desiredReplicas."""
    last_scale_reason: str | None = None
    """Why (the metric, its target, the worlds before and after)."""
    last_activity_time: str | None = None
    """The last poll that saw a request waiting, running or computed."""
    asleep_since: str | None = None
    """Since when the idle worlds sleep (releaseAfterSeconds counts from here)."""
    held_requests: int | None = None
    """Requests the activator holds while no world serves (spec.autoscaling.idle.minAwake 0)."""


class LLMDeploymentStatus(_Status):
    """Observed state, written only by the operator."""

    observed_generation: int | None = None
    """metadata.generation the operator last acted on (its children reconciled to it, or its
    refusal recorded)."""
    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "Sleeping"] | None = None
    """One-word summary of the conditions."""
    replicas: int | None = None
    """Worlds that exist (scale subresource)."""
    ready_replicas: int | None = None
    """Worlds whose engine is alive and admitting requests."""
    worlds_ready: str | None = None
    """readyReplicas/replicas, for kubectl get."""
    selector: str | None = None
    """Label selector of the launcher pods (scale subresource)."""
    endpoint: str | None = None
    """In-cluster OpenAI base URL (the Service)."""
    conditions: list[Condition] | None = Field(default=None, json_schema_extra=map_list("type"))
    """Ready, Reconciling and Stalled (kstatus), Available, Progressing, Degraded, Sleeping."""
    model_revision: str | None = None
    """The model revision every world serves (PATH@DIGEST); while worlds differ, each world's."""
    next_transition: NextTransition | None = None
    """The next scheduled sleep or wake (from spec.sleepSchedules)."""
    sleep_schedule: dict[str, Any] | None = Field(default=None, json_schema_extra=PRESERVE_UNKNOWN)
    """The schedules' memory (since when each is known, the last firing applied)."""
    refusal: Refusal | None = None
    """Set while the operator refuses the current spec (why, and for which generation)."""
    worlds: list[WorldStatus] | None = None
    """One entry per world."""
    rollout: RolloutStatus | None = None
    """The rollout's memory: what an operator restarted at any point resumes from."""
    autoscaling: AutoscalingStatus | None = None
    """What autoscaling measured and decided (spec.autoscaling)."""
    disruption: DisruptionStatus | None = None
    """Node drains under way: the worlds moving off drained nodes (operator/disruption.py)."""
    conflicts: list[Conflict] | None = None
    """Objects named like this LLMDeployment's children that it does not control (never adopted)."""
    api_errors: list[ApiError] | None = None
    """Writes to the deployment-wide children (the endpoint Service, the Secrets) the API server
    refuses, retried with backoff."""
    kopf: dict[str, Any] | None = Field(default=None, json_schema_extra=PRESERVE_UNKNOWN)
    """Bookkeeping of the operator framework (kopf)."""
