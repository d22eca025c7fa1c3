"""Fixtures for the operator tests: a cluster (kmock emulator + kubectl + the simulated
controllers), a real `berth serve` on 127.0.0.1 for each launcher pod, the operator itself."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support import e2e
from tests.support.cluster import Cluster, ClusterSim, running_cluster
from tests.support.engine_endpoint import EngineFleet
from tests.support.image import Image, build_image
from tests.support.kubelet import Kubelet

REPO = Path(__file__).resolve().parents[2]

EXAMPLES = REPO / "manifests" / "examples"


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path) as cluster:
        # kopf's kubeconfig login reads $KUBECONFIG when it logs in.
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        yield cluster
        # The emulator prunes like an API server; the operator must never write what it prunes.
        assert not cluster.emulator.rule_errors, (
            f"the CRD's CEL rules are broken: {cluster.emulator.rule_errors}"
        )
        assert not cluster.pruned_from_operator(), (
            f"the CRD's schema does not declare fields the operator wrote: {cluster.pruned_from_operator()}"
        )


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
    fleet.read_secret = lambda namespace, name: cluster.get("v1/secrets", name, namespace)
    async with ClusterSim(
        cluster, on_pod_start=fleet.on_pod_start, on_pod_stop=fleet.on_pod_stop
    ).running() as sim:
        yield sim


@pytest.fixture(scope="session")
def pod_image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    """The image's contents (images/Dockerfile's steps, mirrored), built once per session."""
    return build_image(tmp_path_factory.mktemp("image"))


@pytest.fixture
async def kubelet(cluster: Cluster, pod_image: Image, tmp_path: Path) -> AsyncIterator[Kubelet]:
    """The real kubelet: every pod runs as processes in its own namespaces (needs root: fails
    loudly without it), on its one node."""
    async with e2e.running_kubelet(cluster, pod_image, tmp_path) as kubelet:
        yield kubelet


@pytest.fixture
async def controllers(cluster: Cluster, kubelet: Kubelet) -> AsyncIterator[ClusterSim]:
    """The StatefulSet and Deployment controllers and the garbage collector, with the real kubelet."""
    async with ClusterSim(cluster, fake_kubelet=False).running() as sim:
        yield sim


@pytest.fixture
def models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint, readable by the pods' non-root user (for the test kubelet's pods)."""
    return e2e.shareable_copy(tiny_model, tmp_path_factory.mktemp("models"))
