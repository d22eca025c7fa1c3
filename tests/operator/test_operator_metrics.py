"""The operator's Prometheus series: how the worlds-by-phase gauge adds up over deployments.
(That the operator's code moves each series, under its documented name, is checked where that
code runs: test_operator_cli.py for reconciles, test_operator_world_restarts.py for restarts and
health probes, test_monitoring_prometheus.py for the series the alerts read, scraped.)"""

from __future__ import annotations

import datetime as dt

from prometheus_client import CollectorRegistry

from berth.operator.metrics import OperatorMetrics
from berth.operator.restarts import RestartPolicy, format_time


def test_worlds_by_phase_sum_over_deployments_and_forget() -> None:
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.set_world_phases("ns", "a", ["Ready", "Ready", "Pending"])
    metrics.set_world_phases("ns", "b", ["Ready", "Failed"])

    def worlds(phase: str) -> float | None:
        return registry.get_sample_value("berth_operator_worlds", {"phase": phase})

    assert (worlds("Ready"), worlds("Pending"), worlds("Failed")) == (3, 1, 1)
    metrics.set_world_phases("ns", "a", ["Ready"])
    assert (worlds("Ready"), worlds("Pending")) == (2, 0)
    metrics.forget("ns", "b")
    assert (worlds("Ready"), worlds("Failed")) == (1, 0)


def test_per_world_series_for_the_alerts_follow_status_and_go_with_the_deployment() -> None:
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    policy = RestartPolicy(max_restarts=5, window_seconds=3600, backoff_seconds=10, max_backoff_seconds=300)
    now = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.timezone.utc)
    recent, old = format_time(now - dt.timedelta(minutes=5)), format_time(now - dt.timedelta(hours=2))
    statuses = [{"index": 0, "restartTimes": [recent, recent, old]}, {"index": 1}]

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"namespace": "ns", "deployment": "a", **labels})

    metrics.set_worlds("ns", "a", statuses, policy, {"failed": {"world": 1, "message": "not Ready"}}, now)
    metrics.round_done("ns", "a")
    # Only restarts inside the window count against the budget.
    assert sample("berth_operator_world_restart_budget_remaining", world="0") == 3
    assert sample("berth_operator_world_restart_budget_remaining", world="1") == 5
    assert sample("berth_operator_rollout_failed", world="1") == 1
    assert sample("berth_operator_last_health_round_timestamp_seconds") > 0

    # The rollout moves on, the deployment scales to one world: their series go.
    metrics.set_worlds("ns", "a", statuses[:1], policy, {}, now)
    assert sample("berth_operator_rollout_failed", world="1") is None
    assert sample("berth_operator_world_restart_budget_remaining", world="1") is None
    metrics.forget("ns", "a")
    assert sample("berth_operator_world_restart_budget_remaining", world="0") is None
    assert sample("berth_operator_last_health_round_timestamp_seconds") is None
