"""Autoscaling decisions (operator/autoscale.py): the HPA's algorithm on the engines' load, the
stabilization windows that keep an oscillating load from flapping the world count, and the two
idle tiers (asleep, then released)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from berth.operator.autoscale import (
    Autoscaler,
    Decision,
    WorldLoad,
    effective_spec,
    metric_value,
    wanted_worlds,
)
from berth.operator.crd_model import AutoscalingSpec, parse_spec

START = dt.datetime(2026, 12, 5, 10, 0, tzinfo=dt.timezone.utc)


def scaling(**fields: Any) -> AutoscalingSpec:
    base = {"minReplicas": 1, "maxReplicas": 4, "target": 2, "windowSeconds": 0}
    return AutoscalingSpec.model_validate({**base, **fields})


def loads(waiting: list[int], tokens: int | None = None, **fields: Any) -> list[WorldLoad]:
    return [
        WorldLoad(index=i, serving=True, settled=True, num_waiting=w, computed_tokens=tokens, **fields)
        for i, w in enumerate(waiting)
    ]


class Run:
    """One autoscaler fed round after round, its status carried as the supervisor carries it."""

    def __init__(self, rules: AutoscalingSpec, replicas: int = 1) -> None:
        self.rules, self.replicas = rules, replicas
        self.autoscaler = Autoscaler()
        self.status: dict[str, Any] = {}
        self.now = START
        self.decisions: list[Decision] = []

    def round(self, world_loads: list[WorldLoad], seconds: float = 1.0) -> Decision:
        self.now += dt.timedelta(seconds=seconds)
        decision = self.autoscaler.decide(self.rules, self.replicas, world_loads, self.status, self.now)
        self.status = decision.status
        self.decisions.append(decision)
        return decision

    def reasons(self) -> list[str]:
        return [reason for decision in self.decisions for _, reason, _ in decision.events]


def test_queue_depth_above_target_adds_worlds_up_to_max() -> None:
    run = Run(scaling())
    first = run.round(loads([5]))  # 5 waiting on 1 world, target 2: ceil(2.5) = 3
    assert first.worlds == 3 and first.status["desiredReplicas"] == 3
    assert first.status["currentValue"] == 5 and first.status["metric"] == "queueDepth"
    assert "queueDepth 5 against target 2 over 1 serving world(s): 1 -> 3" in first.status["lastScaleReason"]
    assert first.status["lastScaleTime"] == "2026-12-05T10:00:01.000000Z"
    assert run.reasons() == ["AutoscaledUp"]
    second = run.round(loads([9, 9, 9]))  # 27 waiting over 3 worlds: ceil(13.5), capped at 4
    assert second.worlds == 4


def test_within_tolerance_nothing_moves() -> None:
    quiet = Run(scaling(tolerance=0.3), replicas=2)
    assert quiet.round(loads([2, 2])).worlds == 2
    assert quiet.round(loads([2, 3])).worlds == 2  # 2.5 / 2 = 1.25: within 30 %
    assert quiet.reasons() == []
    strict = Run(scaling(tolerance=0.1), replicas=2)
    assert strict.round(loads([2, 3])).worlds == 3  # beyond 10 %: ceil(2 x 1.25)


def test_scale_down_waits_for_its_stabilization_window() -> None:
    run = Run(scaling(scaleDown={"stabilizationWindowSeconds": 60}), replicas=3)
    assert run.round(loads([2, 2, 2])).worlds == 3
    for _ in range(5):
        assert run.round(loads([0, 0, 0]), seconds=10).worlds == 3  # 50 s: a 3 is in the window
    assert run.round(loads([0, 0, 0]), seconds=15).worlds == 1  # 65 s: every recommendation says 1
    assert run.reasons() == ["AutoscaledDown"]


def test_an_oscillating_load_changes_the_world_count_at_most_once() -> None:
    # The load swings around the target, well beyond the tolerance, every poll, for ten minutes.
    for up_window in (0, 60):
        run = Run(
            scaling(
                scaleUp={"stabilizationWindowSeconds": up_window},
                scaleDown={"stabilizationWindowSeconds": 120},
            ),
            replicas=2,
        )
        counts = [run.round(loads([4, 4] if step % 2 else [0, 1]), seconds=5).worlds for step in range(120)]
        changes = sum(1 for before, after in zip([2, *counts], counts) if before != after)
        assert changes <= 1, (up_window, counts)
        # Without an up window the first surge scales up once; with one, nothing moves.
        assert changes == (1 if up_window == 0 else 0)


def test_the_window_averages_out_a_spike() -> None:
    run = Run(scaling(windowSeconds=30), replicas=2)
    for _ in range(9):
        run.round(loads([2, 2]), seconds=3)
    spike = run.round(loads([10, 10]), seconds=3)  # one poll of 10 among ten polls of ~2
    assert spike.status["currentValue"] == 2.8 and spike.worlds == 3  # (9 x 2 + 10) / 10 = 2.8
    calm = Run(scaling(windowSeconds=30, tolerance=0.5), replicas=2)
    for _ in range(9):
        calm.round(loads([2, 2]), seconds=3)
    assert calm.round(loads([10, 10]), seconds=3).worlds == 2


def test_no_scale_down_while_worlds_start() -> None:
    run = Run(scaling(scaleDown={"stabilizationWindowSeconds": 0}), replicas=3)
    starting = [
        WorldLoad(index=0, serving=True, settled=True, num_waiting=0),
        WorldLoad(index=1, serving=False, settled=False),
        WorldLoad(index=2, serving=False, settled=False),
    ]
    assert run.round(starting).worlds == 3  # the two new worlds carry no load yet
    assert run.round(loads([0, 0, 0])).worlds == 1


def test_other_metrics() -> None:
    both = [
        WorldLoad(index=0, serving=True, settled=True, num_running=4, kv_cache_usage=0.9),
        WorldLoad(index=1, serving=True, settled=True, num_running=2, kv_cache_usage=0.5),
        WorldLoad(index=2, serving=False, settled=True, num_running=9, kv_cache_usage=1.0),  # asleep
    ]
    assert metric_value("runningRequests", both) == 3
    assert metric_value("kvCacheUsage", both) == 0.7
    assert metric_value("queueDepth", both) == 0
    assert metric_value("queueDepth", both[2:]) is None
    run = Run(scaling(metric="kvCacheUsage", target=0.5), replicas=2)
    assert run.round(both).worlds == 3  # ceil(2 x 0.7 / 0.5)


def test_idle_worlds_sleep_then_are_released_and_a_request_brings_them_back() -> None:
    rules = scaling(
        minReplicas=2,
        scaleDown={"stabilizationWindowSeconds": 0},
        idle={"sleepAfterSeconds": 30, "minAwake": 1, "level": 2, "releaseAfterSeconds": 60, "minWorlds": 0},
    )
    run = Run(rules, replicas=3)
    busy = run.round(loads([2, 2, 2], tokens=100))
    assert busy.worlds == 3 and not busy.asleep
    idle = run.round(loads([0, 0, 0], tokens=100), seconds=29)  # the load stopped: down to minReplicas
    assert idle.worlds == 2 and not idle.asleep and idle.tier(1) == "awake"
    asleep = run.round(loads([0, 0], tokens=100), seconds=2)  # 31 s without a request
    assert asleep.worlds == 2 and asleep.asleep == {1} and asleep.tier(1) == "asleep"
    assert asleep.status["asleepWorlds"] == [1] and "asleepSince" in asleep.status
    held = run.round([*loads([0], tokens=100), WorldLoad(index=1, serving=False, settled=True)], seconds=59)
    assert held.worlds == 2 and held.asleep == {1}
    released = run.round(loads([0], tokens=100), seconds=2)  # 61 s asleep: beyond max(minWorlds, minAwake)
    assert released.worlds == 1 and released.status["released"] is True
    assert released.status["desiredReplicas"] == 2  # what the load asks for once it comes back
    assert run.reasons() == ["AutoscaledDown", "IdleSleep", "IdleRelease"]
    again = run.round(loads([0], tokens=160), seconds=5)  # world 0 computed tokens: a request came
    assert again.worlds == 2 and not again.asleep
    assert "released" not in again.status and "asleepSince" not in again.status
    assert run.reasons()[-1] == "IdleWake"


def test_scale_to_zero_and_the_idle_clock_survives_an_operator_restart() -> None:
    rules = scaling(minReplicas=1, idle={"sleepAfterSeconds": 10, "minAwake": 0, "releaseAfterSeconds": 10})
    run = Run(rules)
    run.round(loads([0], tokens=5))
    run.round(loads([0], tokens=5), seconds=11)
    assert run.decisions[-1].asleep == {0}
    run.autoscaler = Autoscaler()  # a new operator: only status remains
    gone = run.round([WorldLoad(index=0, serving=False, settled=True, computed_tokens=5)], seconds=11)
    assert gone.worlds == 0 and gone.status["worlds"] == 0


def test_the_world_count_every_path_acts_on() -> None:
    spec = parse_spec({"model": {"path": "/m"}, "image": "i", "replicas": 7})
    assert wanted_worlds(spec, {"autoscaling": {"worlds": 2}}) == 7  # no autoscaling: replicas
    scaled = parse_spec(
        {"model": {"path": "/m"}, "image": "i", "replicas": 7, "autoscaling": {"maxReplicas": 5, "target": 1}}
    )
    assert wanted_worlds(scaled, {}) == 5  # the starting point, within the bounds
    assert effective_spec(scaled, {"autoscaling": {"worlds": 0}}).replicas == 0
    assert effective_spec(scaled, {"autoscaling": {"worlds": 9}}).replicas == 5  # maxReplicas lowered since
    assert scaled.replicas == 7  # the spec itself is never changed


def test_lowered_bounds_take_effect_at_once_with_their_reason() -> None:
    run = Run(scaling(scaleDown={"stabilizationWindowSeconds": 600}), replicas=1)
    assert run.round(loads([8])).worlds == 4
    run.rules = scaling(maxReplicas=2, scaleDown={"stabilizationWindowSeconds": 600})
    lowered = run.round(loads([2, 2, 2, 2]))
    assert lowered.worlds == 2 and lowered.events[-1][1] == "AutoscaledDown"
    assert lowered.status["lastScaleReason"] == "minReplicas 1, maxReplicas 2: 4 -> 2 world(s)"


def test_the_activator_is_rendered_only_for_a_deployment_that_may_scale_to_zero() -> None:
    from berth.operator import naming, render

    owner = render.Owner(name="llama", namespace="default", uid="u")
    base = {"model": {"path": "/m"}, "image": "i"}
    scaling = {"maxReplicas": 2, "target": 4}

    def activators(spec: dict[str, Any]) -> list[dict[str, Any]]:
        children = render.children(owner, parse_spec({**base, **spec}))
        return [child for child in children if child["metadata"]["name"] == "llama-activator"]

    assert activators({}) == [] and activators({"autoscaling": scaling}) == []  # minAwake 1
    idle = {"minAwake": 0, "wakeTimeoutSeconds": 45}
    (deployment,) = activators({"autoscaling": {**scaling, "idle": idle}})
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"] == [
        "berth", "activator", "--host", "0.0.0.0", "--port", "8000",
        "--admin-port", "8002", "--wake-timeout", "45",
    ]  # fmt: skip
    # In the Service like a launcher (its selector), but the admin port is no Service's.
    service = render.endpoint_service(owner, parse_spec(base))
    labels = pod["metadata"]["labels"]
    assert all(labels.get(key) == value for key, value in service["spec"]["selector"].items())
    assert [port["targetPort"] for port in service["spec"]["ports"]] == ["http"]
    assert [env["name"] for env in container["env"]] == ["BERTH_ADMIN_TOKEN"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert labels[naming.ROLE] == "activator"


def test_a_world_asleep_for_idleness_does_not_hold_up_a_rollout() -> None:
    import dataclasses

    from berth.operator import rollout

    now = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.timezone.utc)

    def state(index: int, phase: str, idle: bool = False) -> rollout.WorldState:
        admission = "parked" if phase == "Sleeping" else "running"
        return rollout.WorldState(index, phase == "Ready", phase, admission, "launcher", False, idle)

    worlds = [state(0, "Ready"), state(1, "Sleeping", idle=True)]
    taken = rollout.plan(worlds, None, "spec-b", 1, now, drain_timeout=60, startup_timeout=120)
    assert taken.orders == [(0, "drain")]  # the sleeping world is no outage: world 0 goes first
    awake_against_the_plan = [worlds[0], dataclasses.replace(worlds[1], idle=False)]
    held = rollout.plan(awake_against_the_plan, None, "spec-b", 1, now, drain_timeout=60, startup_timeout=120)
    assert held.orders == []  # a world asleep for no reason is out of service: nothing more is taken
