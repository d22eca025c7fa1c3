"""A world is scheduled all together or not at all.

With a gang scheduler (`spec.scheduling.gang`), each world's pods form one group it binds only
when every pod fits: a scheduler-plugins `PodGroup` (coscheduling), a Volcano `PodGroup`, or
Kueue's pod-group labels. Without one (`none`), berth does it itself: a world whose pods are not
all scheduled within `spec.scheduling.timeoutSeconds` is released as a whole (its launcher
deleted, its StatefulSet scaled to 0, so no pod holds a GPU), reported `Unschedulable` with the
scheduler's own message, and tried again after a back-off with jitter, so two deployments that
each hold part of what both need do not wait for each other forever. Releases are not world
restarts: they do not count against `health.maxRestarts`.

Pure functions: time is an argument, the jitter a hash of the world's name and attempt.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from berth.operator.crd_model import LLMDeploymentSpec
from berth.operator.restarts import format_time, parse_time

COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
VOLCANO_ANNOTATION = "scheduling.k8s.io/group-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
POD_GROUP_API = {"coscheduling": "scheduling.x-k8s.io/v1alpha1", "volcano": "scheduling.volcano.sh/v1beta1"}
# The share of a back-off added as jitter, at most: two worlds released together retry apart.
JITTER = 0.5


def members(spec: LLMDeploymentSpec, world: int) -> int:
    """Pods of one world that must run together: the launcher and every worker pod."""
    return spec.nodes_of(world) + 1


def pod_group(owner_meta: dict[str, Any], spec: LLMDeploymentSpec, world: int) -> dict[str, Any] | None:
    """The world's PodGroup (coscheduling, volcano), or None. `owner_meta`: the child metadata
    render gives every child (name, namespace, labels, owner reference)."""
    gang = spec.scheduling.gang
    if gang not in POD_GROUP_API:
        return None
    body: dict[str, Any] = {"minMember": members(spec, world)}
    if gang == "coscheduling":
        body["scheduleTimeoutSeconds"] = spec.scheduling.timeout_seconds
    elif spec.scheduling.queue_name:
        body["queue"] = spec.scheduling.queue_name
    return {"apiVersion": POD_GROUP_API[gang], "kind": "PodGroup", "metadata": owner_meta, "spec": body}


def pod_metadata(spec: LLMDeploymentSpec, world: int, group: str) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) that make a pod a member of the world's group `group`."""
    gang = spec.scheduling.gang
    if gang == "coscheduling":
        return {COSCHEDULING_LABEL: group}, {}
    if gang == "volcano":
        return {}, {VOLCANO_ANNOTATION: group}
    if gang == "kueue":
        labels = {KUEUE_GROUP_LABEL: group}
        if spec.scheduling.queue_name:
            labels[KUEUE_QUEUE_LABEL] = spec.scheduling.queue_name
        return labels, {KUEUE_COUNT_ANNOTATION: str(members(spec, world))}
    return {}, {}


# --- berth's own all-or-nothing (gang none) ----------------------------------------------------


def is_scheduled(pod: Mapping[str, Any]) -> bool:
    """Bound to a node (or past it: a pod that ran was scheduled)."""
    status = pod.get("status") or {}
    return bool((pod.get("spec") or {}).get("nodeName")) or status.get("phase") in (
        "Running",
        "Succeeded",
        "Failed",
    )


def scheduler_message(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """The scheduler's own words for the first unschedulable pod (`0/3 nodes are available: ...`)."""
    for pod in pods:
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                return f"pod {pod['metadata']['name']}: {condition.get('message') or condition.get('reason')}"
    return None


def retry_delay(spec: LLMDeploymentSpec, deployment: str, world: int, attempt: int) -> float:
    """Exponential back-off (health.backoffSeconds, doubling, at most health.maxBackoffSeconds)
    plus up to JITTER of it, different for every deployment, world and attempt."""
    base = min(spec.health.backoff_seconds * 2 ** (attempt - 1), spec.health.max_backoff_seconds)
    digest = hashlib.sha256(f"{deployment}/{world}/{attempt}".encode()).digest()
    return max(base, 1) * (1 + JITTER * digest[0] / 255)


@dataclass(frozen=True)
class Judgement:
    status: dict[str, Any]  # the world's status, with `scheduling` and maybe phase and message
    order: str | None = None  # release: free the world's pods now; resume: bring them back now
    event: tuple[str, str, str] | None = None


def judge(
    status: Mapping[str, Any],
    previous: Mapping[str, Any],
    launcher: Mapping[str, Any] | None,
    workers: list[Mapping[str, Any]],
    spec: LLMDeploymentSpec,
    deployment: str,
    world: int,
    now: dt.datetime,
) -> Judgement:
    """The scheduling part of a world's status (`status` is what worlds.step said)."""
    status = dict(status)
    memory = dict(previous.get("scheduling") or {})
    retry_at = memory.get("retryAt")
    if retry_at is not None and now < parse_time(retry_at):
        status.update(
            scheduling=memory,
            phase="Unschedulable",
            ready=False,
            message=f"{memory.get('message')}; released, holding no pod, tries again at {retry_at}",
        )
        return Judgement(status)
    order = None
    if retry_at is not None:
        memory.pop("retryAt")
        order = "resume"
    pods = [
        pod
        for pod in [launcher, *workers]
        if pod is not None and not pod["metadata"].get("deletionTimestamp")
    ]
    waiting = [pod for pod in pods if not is_scheduled(pod)]
    if status.get("phase") != "Pending" or not waiting or order == "resume":
        memory.pop("waitingSince", None)
        if status.get("phase") not in ("Pending", "Unschedulable"):
            memory.pop("message", None)
        status["scheduling"] = memory or None
        return Judgement(_without_empty(status), order)
    since = parse_time(memory.setdefault("waitingSince", format_time(now)))
    said = scheduler_message(waiting) or "waiting for the scheduler"
    timeout = spec.scheduling.timeout_seconds
    names = ", ".join(sorted(pod["metadata"]["name"] for pod in waiting))
    memory["message"] = (
        f"{len(waiting)} of {members(spec, world)} pods of world {world} not scheduled ({names}): {said}"
    )
    status["message"] = memory["message"]
    if spec.scheduling.gang != "none" or (now - since).total_seconds() < timeout:
        status["scheduling"] = memory
        return Judgement(status)
    attempt = int(memory.get("attempts") or 0) + 1
    retry = now + dt.timedelta(seconds=retry_delay(spec, deployment, world, attempt))
    memory.pop("waitingSince")
    memory.update(
        attempts=attempt,
        retryAt=format_time(retry),
        message=(
            f"not all {members(spec, world)} pods of world {world} were scheduled within {timeout}s: {said}"
        ),
    )
    status.update(
        scheduling=memory,
        phase="Unschedulable",
        ready=False,
        message=f"{memory['message']}; releasing its pods, tries again at {memory['retryAt']}",
    )
    event = ("Warning", "WorldUnschedulable", f"world {world} released: {memory['message']}")
    return Judgement(status, "release", event)


def _without_empty(status: dict[str, Any]) -> dict[str, Any]:
    if not status.get("scheduling"):
        status.pop("scheduling", None)
    return status


def released_worlds(worlds: Iterable[Mapping[str, Any]], now: dt.datetime) -> frozenset[int]:
    """Worlds released for lack of room whose retry time has not come: rendered without pods."""
    return frozenset(
        int(world["index"])
        for world in worlds
        if (retry := (world.get("scheduling") or {}).get("retryAt")) and now < parse_time(retry)
    )


def launcher_may_start(spec: LLMDeploymentSpec, world: int, workers: list[Mapping[str, Any]]) -> bool:
    """Without a gang scheduler the launcher is created once every worker pod is scheduled: its
    wait for the workers (and its startup probe) starts when they have nodes, so image pulls and
    node scale-ups do not eat the engine's load budget. A gang scheduler needs the launcher in
    its group from the start."""
    if spec.scheduling.gang != "none":
        return True
    live = [pod for pod in workers if not pod["metadata"].get("deletionTimestamp")]
    return len(live) >= spec.nodes_of(world) and all(is_scheduled(pod) for pod in live)
