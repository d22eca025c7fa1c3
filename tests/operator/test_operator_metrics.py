"""The operator's Prometheus series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from berth.operator.metrics import OperatorMetrics


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


def test_series_names() -> None:
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.reconciles.labels("success").inc()
    metrics.world_restarts.labels("ns", "llama", "EngineDead").inc()
    metrics.probe_seconds.labels("alive").observe(0.01)
    text = generate_latest(registry).decode()
    for name in (
        'berth_operator_reconciles_total{result="success"} 1.0',
        'berth_operator_world_restarts_total{deployment="llama",namespace="ns",reason="EngineDead"} 1.0',
        'berth_operator_health_probe_duration_seconds_count{result="alive"} 1.0',
        "berth_operator_reconcile_duration_seconds_count 0.0",
    ):
        assert name in text
