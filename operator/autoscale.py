"""Autoscaling decisions: how many worlds a deployment wants, and which of them sleep, from the
load its engines report. Pure (no API calls): the supervisor feeds it each round's polls and
carries out what it decides through the paths scaling already has.

Load-based scaling follows the HorizontalPodAutoscaler's algorithm: the metric (mean over
`windowSeconds` of polls) against its target gives `ceil(serving worlds x metric / target)`,
nothing moves while the ratio stays within the tolerance, and each recommendation is remembered
for the stabilization windows: a scale-up goes only as high as the lowest recommendation of
the up window, a scale-down only as low as the highest of the down window. A load that
oscillates around the target therefore changes nothing.

Idle, in two tiers: once no world has seen a request for `idle.sleepAfterSeconds`, the worlds
beyond `idle.minAwake` are put to sleep (pods and processes kept, woken in seconds); once they
have slept for `idle.releaseAfterSeconds`, the worlds beyond `idle.minWorlds` are deleted
(released). The first request seen again wakes them and restores the load-based count.

What must survive an operator restart (the wanted count, the idle clocks, the last scale) lives
in `status.autoscaling`; the windows' samples are this process's memory, as an HPA's are.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from berth.operator.crd_model import AutoscalingSpec, LLMDeploymentSpec
from berth.operator.restarts import format_time, parse_time

Event = tuple[str, str, str]  # (type, reason, message)


@dataclass(frozen=True)
class WorldLoad:
    """One world's engine as this round's poll saw it."""

    index: int
    serving: bool  # alive and admitting (its load counts in the metric)
    settled: bool  # not starting, restarting or waking (a scale-down waits for those)
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    computed_tokens: int | None = None  # grows with every step the engine runs


@dataclass
class Decision:
    worlds: int  # worlds that exist (the count every other path acts on)
    asleep: frozenset[int]  # worlds put to sleep for idleness
    status: dict[str, Any]  # status.autoscaling
    events: list[Event] = field(default_factory=list)

    def tier(self, index: int) -> str:
        return "asleep" if index in self.asleep else "awake"


def wanted_worlds(spec: LLMDeploymentSpec, status: Mapping[str, Any] | None) -> int:
    """The worlds that should exist: `replicas`, or, with autoscaling, what it decided last
    (`replicas` clamped to its bounds before its first decision)."""
    scaling = spec.autoscaling
    if scaling is None:
        return spec.replicas
    memory = (status or {}).get("autoscaling") or {}
    worlds = memory.get("worlds")
    if isinstance(worlds, int):
        return min(worlds, scaling.max_replicas)
    return _clamp(spec.replicas, scaling)


def effective_spec(spec: LLMDeploymentSpec, status: Mapping[str, Any] | None) -> LLMDeploymentSpec:
    """The spec every path acts on: its `replicas` is the worlds autoscaling wants."""
    worlds = wanted_worlds(spec, status)
    return spec if worlds == spec.replicas else spec.model_copy(update={"replicas": worlds})


def metric_value(metric: str, loads: Sequence[WorldLoad]) -> float | None:
    """The metric over the serving worlds this round (None when none serves)."""
    serving = [load for load in loads if load.serving]
    if not serving:
        return None
    if metric == "queueDepth":
        return sum(load.num_waiting for load in serving) / len(serving)
    if metric == "runningRequests":
        return sum(load.num_running for load in serving) / len(serving)
    return sum(load.kv_cache_usage for load in serving) / len(serving)


def _clamp(value: int, scaling: AutoscalingSpec) -> int:
    return max(scaling.min_replicas, min(scaling.max_replicas, value))


def _seconds(since: str | None, now: dt.datetime) -> float | None:
    return None if not since else (now - parse_time(since)).total_seconds()


class Autoscaler:
    """One deployment's autoscaler; lives as long as its supervisor."""

    def __init__(self) -> None:
        self._samples: deque[tuple[dt.datetime, float]] = deque()
        self._recommendations: deque[tuple[dt.datetime, int]] = deque()
        self._tokens: dict[int, int] = {}  # world -> computed tokens at the previous poll

    def decide(
        self,
        scaling: AutoscalingSpec,
        starting_point: int,
        loads: Sequence[WorldLoad],
        memory: Mapping[str, Any] | None,
        now: dt.datetime,
        held: int = 0,
    ) -> Decision:
        """This round's decision. `starting_point`: spec.replicas; `memory`: the previous
        status.autoscaling; `held`: requests the activator holds for want of a serving world."""
        memory = dict(memory or {})
        events: list[Event] = []
        before = memory.get("desiredReplicas")
        before = before if isinstance(before, int) else starting_point
        current = _clamp(before, scaling)  # the bounds may have changed since

        value = self._windowed(scaling, metric_value(scaling.metric, loads), now)
        serving = sum(1 for load in loads if load.serving)
        recommendation = self._recommend(scaling, current, value, serving, loads)
        desired = self._stabilized(scaling, current, recommendation, now)
        if desired != before:
            if desired != current:
                measured = "nothing measured" if value is None else f"{scaling.metric} {value:.3g}"
                why = f"{measured} against target {scaling.target:g} over {serving} serving world(s)"
            else:
                why = f"minReplicas {scaling.min_replicas}, maxReplicas {scaling.max_replicas}"
            memory["lastScaleTime"] = format_time(now)
            memory["lastScaleReason"] = f"{why}: {before} -> {desired} world(s)"
            reason = "AutoscaledUp" if desired > before else "AutoscaledDown"
            events.append(("Normal", reason, memory["lastScaleReason"]))

        desired, worlds, asleep = self._idle(scaling, desired, loads, memory, now, events, held)
        if held and worlds == 0:
            worlds = desired = 1  # a held request needs a world, whatever minReplicas says
        memory.update(
            metric=scaling.metric,
            currentValue=None if value is None else round(value, 4),
            target=scaling.target,
            desiredReplicas=desired,
            worlds=worlds,
            asleepWorlds=sorted(asleep) or None,
            heldRequests=held or None,
        )
        status = {key: value for key, value in memory.items() if value is not None}
        return Decision(worlds=worlds, asleep=frozenset(asleep), status=status, events=events)

    def _windowed(self, scaling: AutoscalingSpec, value: float | None, now: dt.datetime) -> float | None:
        """The mean of this window's samples (the latest alone with a window of 0)."""
        if value is not None:
            self._samples.append((now, value))
        horizon = now - dt.timedelta(seconds=scaling.window_seconds)
        while self._samples and (
            self._samples[0][0] < horizon or (scaling.window_seconds == 0 and len(self._samples) > 1)
        ):
            self._samples.popleft()
        if not self._samples:
            return None
        return sum(sample for _, sample in self._samples) / len(self._samples)

    @staticmethod
    def _recommend(
        scaling: AutoscalingSpec, current: int, value: float | None, serving: int, loads: Sequence[WorldLoad]
    ) -> int:
        if value is None or serving == 0:
            return current  # nothing measured: nothing to say
        ratio = value / scaling.target
        if abs(ratio - 1.0) <= scaling.tolerance:
            return current
        wanted = _clamp(math.ceil(serving * ratio), scaling)
        if wanted < current and (serving < current or not all(load.settled for load in loads)):
            # Worlds still on their way up carry no load yet: counting them as idle would undo
            # the scale-up that started them.
            return current
        return wanted

    def _stabilized(
        self, scaling: AutoscalingSpec, current: int, recommendation: int, now: dt.datetime
    ) -> int:
        if not self._recommendations:
            # As an HPA does: the count found at the start is the first recommendation, so a
            # fresh (or restarted) operator does not scale down on its very first poll.
            self._recommendations.append((now, current))
        self._recommendations.append((now, recommendation))
        longest = max(
            scaling.scale_up.stabilization_window_seconds, scaling.scale_down.stabilization_window_seconds
        )
        while self._recommendations and self._recommendations[0][0] < now - dt.timedelta(seconds=longest):
            self._recommendations.popleft()

        def within(seconds: int) -> list[int]:
            if seconds == 0:
                return [recommendation]  # no window: this round's alone
            horizon = now - dt.timedelta(seconds=seconds)
            return [value for time, value in self._recommendations if time >= horizon]

        up_limit = min(within(scaling.scale_up.stabilization_window_seconds))
        down_limit = max(within(scaling.scale_down.stabilization_window_seconds))
        desired = current
        if desired < up_limit:
            desired = up_limit
        if desired > down_limit:
            desired = down_limit
        return desired

    def _idle(
        self,
        scaling: AutoscalingSpec,
        desired: int,
        loads: Sequence[WorldLoad],
        memory: dict[str, Any],
        now: dt.datetime,
        events: list[Event],
        held: int,
    ) -> tuple[int, int, set[int]]:
        """(worlds the load asks for, worlds that exist, worlds asleep for idleness)."""
        idle = scaling.idle
        if self._active(loads) or held or not memory.get("lastActivityTime"):
            if memory.get("asleepSince"):
                where = f"{held} request(s) held by the activator" if held else "a request arrived"
                events.append(("Normal", "IdleWake", f"{where}: waking the idle worlds"))
            memory.update(lastActivityTime=format_time(now), asleepSince=None, released=None)
        quiet = _seconds(memory["lastActivityTime"], now) or 0.0
        if idle.sleep_after_seconds is None or quiet < idle.sleep_after_seconds:
            return desired, desired, set()
        if not memory.get("asleepSince"):
            memory["asleepSince"] = format_time(now)
            if desired > idle.min_awake:
                beyond = idle.min_awake
                message = (
                    f"no request for {quiet:.0f}s: the worlds beyond {beyond} sleep at level {idle.level}"
                )
                events.append(("Normal", "IdleSleep", message))
        worlds = desired
        asleep_for = _seconds(memory["asleepSince"], now) or 0.0
        if idle.release_after_seconds is not None and asleep_for >= idle.release_after_seconds:
            kept = max(idle.min_worlds, idle.min_awake)
            if desired > kept and not memory.get("released"):
                message = f"asleep for {asleep_for:.0f}s: the worlds beyond {kept} are released"
                events.append(("Normal", "IdleRelease", message))
                memory["released"] = True
                # The load that asked for them is long gone: the next request starts from the
                # bottom and scales up from there, not from the count before the idle spell.
                desired = _clamp(kept, scaling)
                self._recommendations.clear()
            if memory.get("released"):
                worlds = min(desired, kept)
        return desired, worlds, set(range(idle.min_awake, worlds))

    def _active(self, loads: Sequence[WorldLoad]) -> bool:
        """A request was seen since the previous poll: one waits or runs, or an engine stepped."""
        active = False
        for load in loads:
            previous = self._tokens.get(load.index)
            if load.computed_tokens is not None:
                self._tokens[load.index] = load.computed_tokens
                if previous is not None and load.computed_tokens > previous:
                    active = True
            if load.num_running or load.num_waiting:
                active = True
        return active
