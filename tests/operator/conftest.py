"""Fixtures for the operator tests: a cluster (kmock emulator + kubectl + the simulated
controllers), a real `berth serve` on 127.0.0.1 for each launcher pod, the operator itself."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `tests.support` (tests/ is not a package)

from tests.support.cluster import Cluster, ClusterSim, running_cluster  # noqa: E402
from tests.support.engine_endpoint import EngineFleet  # noqa: E402

EXAMPLES = REPO / "manifests" / "examples"


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path) as cluster:
        # kopf's kubeconfig login reads $KUBECONFIG when it logs in.
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        yield cluster


@pytest.fixture
async def fleet(tiny_model: Path) -> AsyncIterator[EngineFleet]:
    fleet = EngineFleet(tiny_model)
    try:
        yield fleet
    finally:
        await fleet.stop_all()


@pytest.fixture
async def sim(cluster: Cluster, fleet: EngineFleet) -> AsyncIterator[ClusterSim]:
    """StatefulSet controller, kubelet (starting an engine server per launcher pod), GC."""
    async with ClusterSim(
        cluster, on_pod_start=fleet.on_pod_start, on_pod_stop=fleet.on_pod_stop
    ).running() as sim:
        yield sim
