"""The LLMDeployment's conditions and phase, summarised from its worlds.

Conditions follow metav1.Condition (type, status, reason, message, lastTransitionTime,
observedGeneration). Messages say which world and what to do, because `kubectl describe`
and Argo CD show them to someone who has to act.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from berth.operator.restarts import format_time
from berth.operator.schedule import SleepIntent

CONDITION_TYPES = (
    "Ready",
    "Available",
    "Progressing",
    "Degraded",
    "Sleeping",
    "Unreachable",
    "Reconciling",
    "Stalled",
)
PARKED_STATES = ("parking", "parked")


def _condition(kind: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}


def _describe(worlds: Sequence[Mapping[str, Any]], phases: Sequence[str]) -> str:
    return "; ".join(
        f"world {world['index']} {world.get('phase')}: {world.get('message', '')}"
        for world in worlds
        if world.get("phase") in phases
    )


def _degraded(failed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    if failed:
        return _condition("Degraded", True, "RestartBudgetExhausted", _describe(failed, ["Failed"]))
    return _condition("Degraded", False, "RestartBudgetAvailable", "no world has used up its restarts")


def _unreachable(worlds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """True while the operator cannot reach a world's launcher (worlds.step: one the kubelet
    reports Ready is left running; one it does not is restarted)."""
    cut_off = [world for world in worlds if world.get("phase") == "Unreachable"]
    if cut_off:
        return _condition("Unreachable", True, "LauncherUnreachable", _describe(cut_off, ["Unreachable"]))
    return _condition("Unreachable", False, "LaunchersAnswer", "the operator reaches every launcher")


def summarise(
    worlds: Sequence[Mapping[str, Any]],
    desired: int,
    invalid_spec: str | None = None,
    sleep: SleepIntent | None = None,
    retiring: Sequence[Mapping[str, Any]] = (),
    conflicts: Sequence[str] = (),
    rollout: Mapping[str, Any] | None = None,
    reconciled: bool = True,
) -> tuple[list[dict[str, Any]], str]:
    """(conditions without timestamps, phase) for the given world statuses.

    `sleep`: whether the worlds are meant to sleep (schedule.py); a world asleep on purpose is
    settled, one asleep against the intent is being woken. `retiring`: worlds beyond
    `replicas` that drain before they are removed (scale-down). `conflicts`: objects in the way
    that this LLMDeployment does not control (child_problems.py), described. `rollout`: the
    rollout's memory (rollout.py); `reconciled`: the reconcile has acted on this generation.

    Reconciling and Stalled follow kstatus (sigs.k8s.io/cli-utils), which Argo CD, Flux and
    `kubectl wait` read: Reconciling while the operator works toward this spec, Stalled while it
    cannot get there without someone's help, and Ready only once every world serves this spec."""
    conds, phase = _summarise(worlds, desired, invalid_spec, sleep, retiring)
    conds.append(_unreachable(worlds))
    if conflicts and invalid_spec is None:
        # Not ready, whatever the worlds say, until someone removes what is in the way: the
        # operator never takes it over.
        message = "; ".join(conflicts)
        replaced = {
            "Ready": _condition("Ready", False, "ConflictingObject", message),
            "Degraded": _condition("Degraded", True, "ConflictingObject", message),
        }
        conds = [replaced.get(condition["type"], condition) for condition in conds]
        phase = "Degraded"
    return _with_kstatus(conds, invalid_spec, conflicts, rollout or {}, reconciled), phase


def _with_kstatus(
    conds: list[dict[str, Any]],
    invalid_spec: str | None,
    conflicts: Sequence[str],
    rollout: Mapping[str, Any],
    reconciled: bool,
) -> list[dict[str, Any]]:
    by_type = {condition["type"]: condition for condition in conds}
    degraded = by_type.get("Degraded") or {}
    failed = rollout.get("failed")
    stalled: tuple[str, str] | None = None
    if invalid_spec is not None:
        stalled = ("InvalidSpec", f"the spec cannot be deployed: {invalid_spec}")
    elif conflicts:
        stalled = ("ConflictingObject", "; ".join(conflicts))
    elif failed:
        stalled = (
            "RolloutFailed",
            f"the rollout stopped at world {failed.get('world')}: {failed.get('message')}",
        )
    elif degraded.get("status") == "True":
        stalled = (degraded["reason"], degraded["message"])

    progressing = by_type.get("Progressing") or {}
    reconciling: tuple[str, str] | None = None
    if not reconciled:
        reconciling = (
            "GenerationNotReconciled",
            "the operator has not reconciled the children to this spec yet",
        )
    elif rollout.get("target") and not rollout.get("complete") and not failed:
        done = len(rollout.get("done") or [])
        steps = ", ".join(
            f"world {entry['world']} {entry['step']}" for entry in rollout.get("inFlight") or []
        )
        reconciling = (
            "RolloutInProgress",
            f"rolling out: {done} world(s) done" + (f"; {steps}" if steps else ""),
        )
    elif progressing.get("status") == "True":
        reconciling = (progressing["reason"], progressing["message"])

    ready = by_type.get("Ready")
    behind = reconciling if reconciling is not None and reconciling[0] != progressing.get("reason") else None
    if failed:
        behind = stalled
    if ready is not None and ready["status"] == "True" and behind is not None:
        # Ready means every world serves *this* spec: not while the rollout is under way (or
        # stopped), nor before the children are reconciled to it (kubectl wait relies on it).
        by_type["Ready"] = _condition("Ready", False, *behind)
    by_type["Reconciling"] = (
        _condition("Reconciling", True, *reconciling)
        if reconciling is not None and stalled is None
        else _condition("Reconciling", False, "Settled", "nothing left to do for this spec")
    )
    by_type["Stalled"] = (
        _condition("Stalled", True, *stalled)
        if stalled is not None
        else _condition("Stalled", False, "NotStalled", "nothing needs a human")
    )
    return [by_type[kind] for kind in [*(c["type"] for c in conds), "Reconciling", "Stalled"]]


def _summarise(
    worlds: Sequence[Mapping[str, Any]],
    desired: int,
    invalid_spec: str | None,
    sleep: SleepIntent | None,
    retiring: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], str]:
    if invalid_spec is not None:
        return [
            _condition("Ready", False, "InvalidSpec", "the spec cannot be deployed; see Degraded"),
            _condition("Available", False, "InvalidSpec", "no world is built from an invalid spec"),
            _condition("Progressing", False, "InvalidSpec", "waiting for a corrected spec"),
            _condition(
                "Degraded",
                True,
                "InvalidSpec",
                f"the LLMDeployment can never be deployed as it is; fix it: {invalid_spec}",
            ),
            _condition("Sleeping", False, "InvalidSpec", "no world runs"),
        ], "Degraded"

    ready = [world for world in worlds if world.get("phase") == "Ready"]
    failed = [world for world in worlds if world.get("phase") == "Failed"]
    starting = [world for world in worlds if world.get("phase") not in ("Ready", "Failed")]
    parked = [world for world in worlds if world.get("admission") in PARKED_STATES]
    counts = f"{len(ready)}/{desired} worlds ready"

    if desired == 0:
        conditions = [
            _condition("Ready", True, "ScaledToZero", "replicas is 0: no world is wanted"),
            _condition("Available", False, "ScaledToZero", "replicas is 0: the endpoint has no backend"),
            _condition("Progressing", False, "ScaledToZero", "nothing to do"),
            _condition("Degraded", False, "ScaledToZero", "nothing runs"),
            _condition("Sleeping", False, "ScaledToZero", "nothing runs"),
        ]
        return conditions, "Ready"

    failing = any(world.get("phase") in ("Restarting", "BackingOff") for world in starting)
    if sleep is not None and sleep.asleep:
        return _asleep(worlds, desired, sleep, failed, failing)

    all_ready = len(ready) == desired and len(worlds) >= desired
    conditions = [
        _condition("Ready", all_ready, "AllWorldsReady" if all_ready else "WorldsNotReady", counts),
        _condition(
            "Available",
            bool(ready),
            "MinimumWorldsReady" if ready else "NoWorldReady",
            f"{counts}; the endpoint serves from {len(ready)} world(s)"
            if ready
            else f"{counts}; requests fail",
        ),
    ]
    if starting:
        waking = any(world.get("phase") in ("Sleeping", "Waking") for world in starting)
        conditions.append(
            _condition(
                "Progressing",
                True,
                "WorldRestarting" if failing else "WorldsWaking" if waking else "WorldsStarting",
                _describe(starting, [world.get("phase") for world in starting]),
            )
        )
    elif retiring:
        conditions.append(
            _condition(
                "Progressing",
                True,
                "WorldsRetiring",
                _describe(retiring, ["Retiring"]) or f"{len(retiring)} world(s) draining before removal",
            )
        )
    else:
        conditions.append(_condition("Progressing", False, "WorldsSettled", counts))
    conditions.append(_degraded(failed))
    sleeping = len(parked) == desired
    conditions.append(
        _condition(
            "Sleeping",
            sleeping,
            "EnginesParked" if sleeping else "Awake",
            f"{len(parked)}/{desired} engines parked "
            "(device memory released; GPUs stay allocated to the pods)",
        )
    )

    if failed:
        phase = "Degraded"
    elif sleeping:
        phase = "Sleeping"
    elif all_ready:
        phase = "Ready"
    elif any(world.get("phase") not in ("Pending",) for world in worlds):
        phase = "Progressing"
    else:
        phase = "Pending"
    return conditions, phase


def _asleep(
    worlds: Sequence[Mapping[str, Any]],
    desired: int,
    sleep: SleepIntent,
    failed: Sequence[Mapping[str, Any]],
    failing: bool,
) -> tuple[list[dict[str, Any]], str]:
    """The worlds are meant to sleep (spec.sleep or a schedule): parked is where they belong."""
    parked = [world for world in worlds if world.get("admission") == "parked"]
    on_the_way = [
        world for world in worlds if world.get("admission") != "parked" and world.get("phase") != "Failed"
    ]
    asleep = len(parked) == desired and len(worlds) >= desired
    why = f"asleep at level {sleep.level} by {sleep.source}"
    counts = f"{len(parked)}/{desired} engines parked"
    conditions = [
        _condition("Ready", False, "Sleeping", f"{why}: {counts}; no world admits requests"),
        _condition("Available", False, "Sleeping", f"{why}: the endpoint has no ready backend"),
    ]
    if on_the_way:
        conditions.append(
            _condition(
                "Progressing",
                True,
                "WorldRestarting" if failing else "WorldsParking",
                _describe(on_the_way, [world.get("phase") for world in on_the_way]),
            )
        )
    else:
        conditions.append(_condition("Progressing", False, "Asleep", f"{why}: {counts}"))
    conditions.append(_degraded(failed))
    # A sleep on schedule is the plan, a sleep asked for in spec.sleep is someone's decision:
    # Argo CD shows the first Healthy, the second Suspended (manifests/argocd/health.lua).
    # So is a sleep for idleness (spec.autoscaling.idle): the first request wakes it.
    parked_reason = (
        "ScheduledSleep"
        if sleep.source.startswith("schedule")
        else "IdleSleep"
        if sleep.source.startswith("autoscaling")
        else "EnginesParked"
    )
    conditions.append(
        _condition(
            "Sleeping",
            asleep,
            parked_reason if asleep else "Parking",
            f"{why}: {counts} (device memory released; GPUs stay allocated to the pods)",
        )
    )
    phase = "Degraded" if failed else "Sleeping" if asleep else "Progressing"
    return conditions, phase


def merge_conditions(
    previous: Sequence[Mapping[str, Any]] | None,
    current: Sequence[Mapping[str, Any]],
    now: dt.datetime,
    generation: int | None,
) -> list[dict[str, Any]]:
    """Stamp lastTransitionTime, keeping the old one where the status did not change."""
    before = {condition.get("type"): condition for condition in previous or []}
    merged = []
    for condition in current:
        old = before.get(condition["type"])
        stamped = dict(condition)
        if old is not None and old.get("status") == condition["status"] and old.get("lastTransitionTime"):
            stamped["lastTransitionTime"] = old["lastTransitionTime"]
        else:
            stamped["lastTransitionTime"] = format_time(now)
        if generation is not None:
            stamped["observedGeneration"] = generation
        merged.append(stamped)
    return merged


def find(conditions: Sequence[Mapping[str, Any]] | None, kind: str) -> Mapping[str, Any] | None:
    return next((condition for condition in conditions or [] if condition.get("type") == kind), None)
