"""The operator's Prometheus series: how the worlds-by-phase gauge adds up over deployments.
(That the operator's code moves each series, under its documented name, is checked where that
code runs: test_operator_cli.py for reconciles, test_operator_world_restarts.py for restarts and
health probes.)"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

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
