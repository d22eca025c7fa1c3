"""The operator's Prometheus metrics (served by `berth operator --metrics-port`)."""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from collections import Counter as Tally

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from berth.operator.restarts import RestartPolicy, recent_restarts

RECONCILE_RESULTS = ("success", "retry", "invalid")
# status.autoscaling key -> gauge name, help. The metric's value goes to the gauge of its name.
AUTOSCALING_GAUGES = (
    ("queueDepth", "queue_depth", "Requests waiting per serving world (mean over the autoscaling window)."),
    (
        "kvCacheUsage",
        "kv_cache_usage",
        "Mean fraction of KV cache blocks in use (over the autoscaling window).",
    ),
    (
        "runningRequests",
        "running_requests",
        "Requests running per serving world (over the autoscaling window).",
    ),
    ("target", "autoscaling_target", "The autoscaling metric's target."),
    ("desiredReplicas", "desired_worlds", "Worlds the load asks for (within minReplicas and maxReplicas)."),
    ("worlds", "worlds", "Worlds that exist (fewer than desired while idle worlds are released)."),
    ("asleepWorlds", "asleep_worlds", "Worlds asleep for idleness."),
)


class OperatorMetrics:
    """Every series the operator exports. One instance per registry (tests may use their own)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.reconciles = Counter(
            "berth_operator_reconciles",
            "LLMDeployment reconciles by result (success, retry: transient API error, invalid: bad spec).",
            ["result"],
            registry=registry,
        )
        self.reconcile_seconds = Histogram(
            "berth_operator_reconcile_duration_seconds",
            "Time to bring one LLMDeployment's children to the desired state.",
            registry=registry,
        )
        self.world_restarts = Counter(
            "berth_operator_world_restarts",
            "Whole-world restarts by reason (EngineDead, LauncherFailed, WorkerFailed, ...).",
            ["namespace", "deployment", "reason"],
            registry=registry,
        )
        self.probe_seconds = Histogram(
            "berth_operator_health_probe_duration_seconds",
            "Latency of one health poll of a launcher (/health and /ready) by result.",
            ["result"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        )
        self.transitions = Counter(
            "berth_operator_engine_transitions",
            "Sleeps, wakeups and weight swaps the operator asked engines for, by why and result "
            "(done, conflict, refused, dead, unreachable, failed).",
            ["namespace", "deployment", "transition", "purpose", "result"],
            registry=registry,
        )
        self.transition_seconds = Histogram(
            "berth_operator_engine_transition_duration_seconds",
            "How long one sleep (drain included), wakeup or weight swap took, as the operator waited.",
            ["transition"],
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=registry,
        )
        self.rollout_worlds = Gauge(
            "berth_operator_rollout_worlds",
            "Worlds of the current rollout by state (done, in_flight, waiting), per LLMDeployment.",
            ["namespace", "deployment", "state"],
            registry=registry,
        )
        self.worlds = Gauge(
            "berth_operator_worlds", "Worlds of all LLMDeployments by phase.", ["phase"], registry=registry
        )
        # What the alert rules (manifests/monitoring/) read: per world, the restarts left before
        # its budget is spent; the world a rollout stopped on; when each deployment's health
        # loop last completed a round; whether this replica is the one acting.
        self.restart_budget_remaining = Gauge(
            "berth_operator_world_restart_budget_remaining",
            "Restarts a world may still have inside spec.health.restartWindowSeconds (0: the next "
            "death fails it).",
            ["namespace", "deployment", "world"],
            registry=registry,
        )
        self.rollout_failed = Gauge(
            "berth_operator_rollout_failed",
            "1 for the world a rollout stopped on (Failed, or not Ready in time); absent otherwise.",
            ["namespace", "deployment", "world"],
            registry=registry,
        )
        self.last_round = Gauge(
            "berth_operator_last_health_round_timestamp_seconds",
            "When the health loop of an LLMDeployment last completed a round (status written).",
            ["namespace", "deployment"],
            registry=registry,
        )
        self.leader = Gauge(
            "berth_operator_leader",
            "1 while this operator replica is the one acting, 0 otherwise.",
            registry=registry,
        )
        self._world_series: dict[tuple[str, str], set[str]] = {}
        # What autoscaling measured and decided, per LLMDeployment (status.autoscaling).
        self.autoscaling = {
            key: Gauge(f"berth_llmdeployment_{metric}", text, ["namespace", "name"], registry=registry)
            for key, metric, text in AUTOSCALING_GAUGES
        }
        self._phases: dict[tuple[str, str], Tally[str]] = {}
        # Their sum, kept as they change: every deployment's daemon sets its share every round,
        # and summing them all each time grew with the square of the deployments.
        self._phase_total: Tally[str] = Tally()
        self._lock = threading.Lock()

    def set_world_phases(self, namespace: str, deployment: str, phases: list[str]) -> None:
        """Replace one deployment's share of the worlds-by-phase gauge."""
        with self._lock:
            share = Tally(phases)
            before = self._phases.get((namespace, deployment), Tally())
            if share == before and (namespace, deployment) in self._phases:
                return
            self._phases[(namespace, deployment)] = share
            self._phase_total.subtract(before)
            self._phase_total.update(share)
            self._publish()

    def set_rollout(self, namespace: str, deployment: str, memory: dict, replicas: int) -> None:
        done = len(memory.get("done") or [])
        in_flight = len(memory.get("inFlight") or [])
        waiting = 0 if memory.get("complete") else max(replicas - done - in_flight, 0)
        for state, value in (("done", done), ("in_flight", in_flight), ("waiting", waiting)):
            self.rollout_worlds.labels(namespace, deployment, state).set(value)

    def set_worlds(
        self,
        namespace: str,
        deployment: str,
        statuses: list[dict],
        policy: RestartPolicy,
        rollout_memory: dict,
        now: dt.datetime,
    ) -> None:
        """One deployment's per-world series, from the world statuses of this round."""
        worlds = {str(world["index"]) for world in statuses}
        for gone in self._world_series.get((namespace, deployment), set()) - worlds:
            with contextlib.suppress(KeyError):
                self.restart_budget_remaining.remove(namespace, deployment, gone)
        self._world_series[(namespace, deployment)] = worlds
        for world in statuses:
            recent = recent_restarts(world.get("restartTimes") or [], now, policy.window_seconds)
            left = max(policy.max_restarts - len(recent), 0)
            self.restart_budget_remaining.labels(namespace, deployment, str(world["index"])).set(left)
        self._clear_rollout_failed(namespace, deployment)
        failed = rollout_memory.get("failed")
        if failed:
            self.rollout_failed.labels(namespace, deployment, str(failed["world"])).set(1)

    def round_done(self, namespace: str, deployment: str) -> None:
        self.last_round.labels(namespace, deployment).set_to_current_time()

    def _clear_rollout_failed(self, namespace: str, deployment: str) -> None:
        for metric in self.rollout_failed.collect():
            for sample in metric.samples:
                labels = sample.labels
                if (labels["namespace"], labels["deployment"]) == (namespace, deployment):
                    with contextlib.suppress(KeyError):
                        self.rollout_failed.remove(namespace, deployment, labels["world"])

    def set_autoscaling(self, namespace: str, deployment: str, status: dict) -> None:
        """One deployment's status.autoscaling as gauges (the metric under its own name)."""
        values = {**status, status.get("metric"): status.get("currentValue")}
        values["asleepWorlds"] = len(status.get("asleepWorlds") or [])
        for key, gauge in self.autoscaling.items():
            if isinstance(values.get(key), (int, float)):
                gauge.labels(namespace, deployment).set(values[key])
            else:
                with contextlib.suppress(KeyError):
                    gauge.remove(namespace, deployment)

    def forget(self, namespace: str, deployment: str) -> None:
        for gauge in self.autoscaling.values():
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, deployment)
        for state in ("done", "in_flight", "waiting"):
            with contextlib.suppress(KeyError):
                self.rollout_worlds.remove(namespace, deployment, state)
        for world in self._world_series.pop((namespace, deployment), set()):
            with contextlib.suppress(KeyError):
                self.restart_budget_remaining.remove(namespace, deployment, world)
        self._clear_rollout_failed(namespace, deployment)
        with contextlib.suppress(KeyError):
            self.last_round.remove(namespace, deployment)
        with self._lock:
            self._phase_total.subtract(self._phases.pop((namespace, deployment), Tally()))
            self._publish()

    def _publish(self) -> None:
        total = self._phase_total
        for phase in set(total) | {labels[0] for labels in self._known_phases()}:
            self.worlds.labels(phase).set(total.get(phase, 0))

    def _known_phases(self) -> list[tuple[str, ...]]:
        # prometheus_client keeps no public list of a metric's children; read them from a
        # collection, which is the public way.
        return [(sample.labels["phase"],) for metric in self.worlds.collect() for sample in metric.samples]


_default: OperatorMetrics | None = None
_default_lock = threading.Lock()


def metrics() -> OperatorMetrics:
    """The process-wide metrics on prometheus_client's default registry."""
    global _default
    with _default_lock:
        if _default is None:
            _default = OperatorMetrics()
        return _default


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Expose /metrics in a background thread."""
    metrics()
    start_http_server(port, addr=address)
