"""One world's state, one poll at a time: pods and the engine's answer in, status and orders out.

`step()` is pure (time is an argument), so the whole failure → backoff → restart → budget
story is unit-tested without a cluster; the health daemon (handlers.py) only gathers the
inputs and carries out the order.

A world is restarted *whole* (launcher and all worker pods) because it is one MPI job: a rank
that disappears takes the collective down, and a launcher that lost its mpirun cannot rejoin.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from berth.operator import naming
from berth.operator.crd_model import LLMDeploymentSpec
from berth.operator.health import Probe
from berth.operator.restarts import RestartPolicy, decide, format_time, recent_restarts

# Phases in which the engine has answered since the world last (re)started: from here on an
# unanswered poll counts toward failureThreshold (before, the model may still be loading).
UP_PHASES = ("Ready", "NotReady", "Sleeping", "Waking", "Unreachable")
# The engine's admission states while it sleeps (world phase Sleeping) and wakes (Waking).
ASLEEP_STATES = ("parking", "parked")
FAILING_PHASES = ("Restarting", "BackingOff", "Failed")
# Fields of a world's status that outlive one poll (the rest is recomputed every time).
PERSISTENT = (
    "restarts",
    "restartTimes",
    "lastRestartTime",
    "lastRestartReason",
    "lastEngineError",
    "lastErrorTime",
    "members",
    "probeFailures",
    "modelRevision",
    "modelRevisionLabel",
    "lastTransition",
    "recentRestarts",
)


@dataclass(frozen=True)
class Failure:
    # EngineDead, Stalled, OOMKilled, LauncherFailed, LauncherExited, LauncherGone, WorkerFailed,
    # WorkerRestarted, Unreachable
    reason: str
    error: str
    node: str | None = None  # the node of the pod at fault (the launcher's for an engine failure)


# How many restarts `recentRestarts` keeps, newest last, and how much of each error.
RESTART_HISTORY = 5
ERROR_LINE_CHARS = 300


@dataclass(frozen=True)
class PodView:
    """What the pods of one world say."""

    running: bool  # launcher and every worker Running with an IP, none terminating
    waiting: str  # why not running (for the status message)
    failure: Failure | None
    snapshot: dict[str, str]  # pod name -> "uid/restartCount" of the world's current pods
    launcher_node: str | None = None
    # The kubelet's opinion of the launcher: its readiness probe (/ready) passes. A second
    # opinion for a launcher the operator cannot reach (see `step`).
    launcher_ready: bool = False


@dataclass(frozen=True)
class WorldStep:
    status: dict[str, Any]
    restart: Failure | None = None  # the daemon must restart the world now
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)


def _phase(pod: Mapping[str, Any] | None) -> str:
    return ((pod or {}).get("status") or {}).get("phase") or "Pending"


def _terminating(pod: Mapping[str, Any]) -> bool:
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def _restart_count(pod: Mapping[str, Any]) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(int(status.get("restartCount") or 0) for status in statuses)


def _termination_text(pod: Mapping[str, Any]) -> str:
    """The most specific reason a pod's container ended, for humans."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated") or (
            container.get("lastState") or {}
        ).get("terminated")
        if terminated:
            text = f"container {container.get('name')} exited with code {terminated.get('exitCode')}"
            if terminated.get("reason"):
                text += f" ({terminated['reason']})"
            if terminated.get("message"):
                text += f": {terminated['message'].strip()}"
            return text
    return status.get("message") or status.get("reason") or "pod failed"


def _termination_reason(pod: Mapping[str, Any]) -> str | None:
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated") or {}
        if terminated.get("reason"):
            return terminated["reason"]
    return None


def _pod_failure(reason: str, which: str, pod: Mapping[str, Any]) -> Failure:
    """A failed pod's Failure; one the kernel's OOM killer ended is `OOMKilled` (the fix is
    memory: limits, the KV cache's size, not code)."""
    if _termination_reason(pod) == "OOMKilled":
        reason = "OOMKilled"
    return Failure(reason, f"{which}: {_termination_text(pod)}", _node(pod))


def _node(pod: Mapping[str, Any] | None) -> str | None:
    return ((pod or {}).get("spec") or {}).get("nodeName")


def _restart_record(failure: Failure, now: dt.datetime) -> dict[str, Any]:
    """One entry of `recentRestarts`: when, why, the error's last line (a traceback ends with
    the exception), and on which node (a node that keeps appearing is the suspect)."""
    lines = [line.strip() for line in failure.error.strip().splitlines() if line.strip()]
    last_line = lines[-1] if lines else failure.error
    if len(last_line) > ERROR_LINE_CHARS:
        last_line = last_line[: ERROR_LINE_CHARS - 3] + "..."
    return {"time": format_time(now), "reason": failure.reason, "error": last_line, "node": failure.node}


def snapshot_of(pods: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    return {pod["metadata"]["name"]: f"{pod['metadata'].get('uid')}/{_restart_count(pod)}" for pod in pods}


def view_pods(
    deployment: str,
    world: int,
    launcher: Mapping[str, Any] | None,
    workers: Sequence[Mapping[str, Any]],
    nodes: int,
    members: Mapping[str, str],
) -> PodView:
    """Judge the world's pods. `members` is the snapshot taken when the world came up."""
    launcher_name = naming.launcher_pod_name(deployment, world)
    current = [pod for pod in [launcher, *workers] if pod is not None]
    snapshot = snapshot_of(current)
    failure: Failure | None = None

    if launcher is not None and _phase(launcher) == "Failed":
        failure = _pod_failure("LauncherFailed", f"launcher pod {launcher_name}", launcher)
    elif launcher is not None and _phase(launcher) == "Succeeded":
        # A launcher serves until it is stopped: one that ended on its own (even with exit code 0)
        # has ended its world, and nothing else would ever restart it (restartPolicy Never).
        failure = Failure(
            "LauncherExited",
            f"launcher pod {launcher_name} ended on its own: {_termination_text(launcher)}",
            _node(launcher),
        )
    for pod in workers:
        if failure is None and _phase(pod) in ("Failed", "Succeeded"):
            failure = _pod_failure("WorkerFailed", f"worker pod {pod['metadata']['name']}", pod)

    if failure is None and members:
        by_name = {pod["metadata"]["name"]: pod for pod in current}
        for name, identity in sorted(members.items()):
            pod = by_name.get(name)
            uid, _, restarts = identity.partition("/")
            if pod is None or _terminating(pod) or pod["metadata"].get("uid") != uid:
                reason = "LauncherGone" if name == launcher_name else "WorkerRestarted"
                failure = Failure(reason, f"pod {name} was deleted or replaced while the world ran")
                break
            if _restart_count(pod) > int(restarts or 0):
                failure = Failure(
                    "WorkerRestarted",
                    f"pod {name} restarted while the world ran: {_termination_text(pod)}",
                    _node(pod),
                )
                break

    live_workers = [pod for pod in workers if not _terminating(pod)]
    if launcher is None:
        waiting = f"launcher pod {launcher_name} does not exist yet"
    elif _terminating(launcher):
        waiting = f"launcher pod {launcher_name} is terminating"
    elif _phase(launcher) != "Running" or not (launcher.get("status") or {}).get("podIP"):
        waiting = (
            f"launcher pod {launcher_name} is {_phase(launcher)} "
            f"(see `kubectl describe pod {launcher_name}`: scheduling, image pull, volumes)"
        )
    elif len(live_workers) < nodes:
        waiting = f"{len(live_workers)}/{nodes} worker pods of {naming.world_name(deployment, world)} exist"
    elif not all(_phase(pod) == "Running" for pod in live_workers):
        pending = sorted(pod["metadata"]["name"] for pod in live_workers if _phase(pod) != "Running")
        waiting = f"worker pods not running yet: {', '.join(pending)}"
    else:
        waiting = ""
    return PodView(
        running=not waiting,
        waiting=waiting,
        failure=failure,
        snapshot=snapshot,
        launcher_node=_node(launcher),
        launcher_ready=launcher is not None and _ready(launcher),
    )


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def step(
    world: int,
    previous: Mapping[str, Any],
    pods: PodView,
    probe: Probe | None,
    now: dt.datetime,
    spec: LLMDeploymentSpec,
    deployment: str,
) -> WorldStep:
    status: dict[str, Any] = {key: previous[key] for key in PERSISTENT if key in previous}
    status.update(index=world, launcherPod=naming.launcher_pod_name(deployment, world), ready=False)
    status.setdefault("restarts", 0)
    status.setdefault("probeFailures", 0)
    previous_phase = previous.get("phase", "Pending")
    events: list[tuple[str, str, str]] = []

    failure = pods.failure
    if failure is None and probe is not None and pods.running:
        if probe.status == "dead":
            # A stalled engine is alive and stuck (a stopped rank, a hung collective or device).
            reason = "Stalled" if probe.death == "stalled" else "EngineDead"
            failure = Failure(reason, probe.error or "engine reported dead", pods.launcher_node)
        elif probe.status == "unreachable":
            if previous_phase in UP_PHASES:
                status["probeFailures"] = int(status["probeFailures"]) + 1
                threshold = spec.health.failure_threshold
                if status["probeFailures"] >= threshold and pods.launcher_ready:
                    # The kubelet, next to the pod, sees it serve: the fault is between the
                    # operator and the pod (a NetworkPolicy, the CNI, an operator running outside
                    # the cluster). Restarting a serving world would not fix that: report it.
                    status.update(
                        phase="Unreachable",
                        message=(
                            f"the operator cannot reach the launcher ({probe.error}), but the kubelet "
                            "reports its pod Ready: not restarted; check the network between them"
                        ),
                    )
                    if status["probeFailures"] == threshold:
                        events.append(("Warning", "WorldUnreachable", f"world {world}: {status['message']}"))
                elif status["probeFailures"] >= threshold:
                    failure = Failure(
                        "Unreachable",
                        f"launcher did not answer {threshold} polls in a row: {probe.error}",
                        pods.launcher_node,
                    )
                else:
                    status.update(
                        phase="Unreachable",
                        message=(
                            f"launcher did not answer ({status['probeFailures']}/{threshold}): {probe.error}"
                        ),
                    )
            else:
                status.update(
                    phase="Starting", message=f"waiting for the engine to answer /health ({probe.error})"
                )
        else:
            if int(status["probeFailures"]) >= spec.health.failure_threshold:
                events.append(("Normal", "WorldReachable", f"world {world}: the launcher answers again"))
            status["probeFailures"] = 0
            status["admission"] = probe.admission or "running"
            if probe.model_revision is not None:
                status["modelRevision"] = probe.model_revision
                if probe.model_label is not None:
                    status["modelRevisionLabel"] = probe.model_label
                else:
                    status.pop("modelRevisionLabel", None)
            if probe.sleep_level is not None:
                status["sleepLevel"] = probe.sleep_level
            if not status.get("members"):
                # The world is up: remember exactly which pods it runs on, so that one of
                # them being replaced or restarted later is recognised as the world's death.
                status["members"] = pods.snapshot
            if probe.ready:
                status.update(phase="Ready", ready=True, message="engine alive and admitting requests")
            elif status["admission"] in ASLEEP_STATES:
                level = f" at level {probe.sleep_level}" if probe.sleep_level else ""
                status.update(
                    phase="Sleeping",
                    message=f"engine asleep{level} (admission: {status['admission']}); out of the Service",
                )
            elif status["admission"] == "waking":
                status.update(phase="Waking", message="engine waking up (admission: waking)")
            elif status["admission"] == "loading":
                # The launcher answers while its engine loads: how far the load has come.
                status.update(phase="Starting", message=f"engine loading: {probe.loading or 'starting'}")
            else:
                status.update(
                    phase="NotReady",
                    message=f"engine alive but not admitting requests (admission: {status['admission']})",
                )
    elif failure is None:
        status.update(phase="Pending" if not pods.running else "Starting", message=pods.waiting or "waiting")

    if failure is not None:
        return _on_failure(world, status, previous, failure, now, spec, events)

    if status["phase"] == "Ready" and previous_phase != "Ready":
        events.append(("Normal", "WorldReady", f"world {world} is ready"))
    return WorldStep(status=status, events=events)


def _on_failure(
    world: int,
    status: dict[str, Any],
    previous: Mapping[str, Any],
    failure: Failure,
    now: dt.datetime,
    spec: LLMDeploymentSpec,
    events: list[tuple[str, str, str]],
) -> WorldStep:
    policy = RestartPolicy.from_spec(spec.health)
    previous_phase = previous.get("phase", "Pending")
    if previous.get("lastEngineError") != failure.error or previous_phase not in FAILING_PHASES:
        status["lastErrorTime"] = format_time(now)
    status["lastEngineError"] = failure.error
    decision = decide(status.get("restartTimes", []), now, policy)

    if decision.action == "restart":
        history = [*status.get("recentRestarts", []), _restart_record(failure, now)][-RESTART_HISTORY:]
        recent = [
            format_time(t)
            for t in recent_restarts(status.get("restartTimes", []), now, policy.window_seconds)
        ]
        status.update(
            phase="Restarting",
            restarts=int(status.get("restarts", 0)) + 1,
            restartTimes=[*recent, format_time(now)],
            lastRestartTime=format_time(now),
            lastRestartReason=failure.reason,
            recentRestarts=history,
            probeFailures=0,
            members={},
            message=f"restarting the whole world after {failure.reason}: {failure.error}",
        )
        events.append(
            ("Warning", "WorldRestarted", f"world {world} restarted ({failure.reason}): {failure.error}")
        )
        return WorldStep(status=status, restart=failure, events=events)

    if decision.action == "wait":
        status.update(
            phase="BackingOff",
            message=(
                f"{failure.reason}: {failure.error}; restarting in {decision.seconds:.0f}s "
                f"(restart {decision.restarts_in_window + 1} of {policy.max_restarts} "
                f"within {policy.window_seconds:.0f}s)"
            ),
        )
        return WorldStep(status=status, events=events)

    status.update(
        phase="Failed",
        message=(
            f"{failure.reason}: {failure.error}; {decision.restarts_in_window} restarts within "
            f"{policy.window_seconds:.0f}s used up the budget (health.maxRestarts={policy.max_restarts}). "
            f"Fix the cause (kubectl logs pod/{status['launcherPod']}); the operator restarts the world "
            f"again in {decision.seconds:.0f}s"
        ),
    )
    if previous_phase != "Failed":
        events.append(
            (
                "Warning",
                "RestartBudgetExhausted",
                f"world {world} gave up after {failure.reason}: {failure.error}",
            )
        )
    return WorldStep(status=status, events=events)
