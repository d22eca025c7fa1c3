"""Uninstall never hangs: no LLMDeployment carries a finalizer, so `kubectl delete llmd` completes
with the operator stopped (uninstalled, crashed, out of RBAC) and the garbage collector takes the
children by their owner references. An object an older operator finalized loses the finalizer
when this one starts. Deleted while the operator runs, its health daemon stops: on the watch's
DELETED event, or, had the watch missed it, at its next status write."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY

from berth.operator import handlers, health
from berth.operator.kube import Kube
from berth.operator.metrics import metrics
from berth.operator.supervisor import OwnerGone, Supervisor
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.operator_runner import running_operator

LLMD = "berth.dev/v1alpha1/llmdeployments"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"
LAST_ROUND = "berth_operator_last_health_round_timestamp_seconds"


def manifest(tmp_path: Path, name: str, **metadata: Any) -> Path:
    # No worlds: the Secrets, the endpoint Service and the daemon are what an LLMDeployment always has.
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"].update(name=name, **metadata)
    doc["spec"].update(replicas=0, frontends=0, health={"intervalSeconds": 1, "timeoutSeconds": 1})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def finalizers(cluster: Cluster, name: str) -> list[str] | None:
    obj = cluster.get(LLMD, name)
    return None if obj is None else obj["metadata"].get("finalizers") or []


def children(cluster: Cluster, name: str) -> list[str]:
    secrets = [s for s in cluster.names("v1/secrets") if s.startswith(f"{name}-")]
    return secrets + [s for s in cluster.names("v1/services") if s == name]


def daemon_rounds(name: str) -> float | None:
    return REGISTRY.get_sample_value(LAST_ROUND, {"namespace": "default", "deployment": name})


async def test_deletion_needs_no_operator(
    cluster: Cluster, sim: ClusterSim, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with running_operator(cluster):
        # Left by an older operator: this one needs no finalizer and takes it off.
        older = manifest(tmp_path, "llama", finalizers=[handlers.FINALIZER])
        await cluster.kubectl("apply", "--validate=false", "-f", str(older))
        await wait_for(lambda: len(children(cluster, "llama")) == 4, 10, "llama's children")
        await wait_for(lambda: finalizers(cluster, "llama") == [], 10, "the older finalizer removed")

        # Deleted while the operator runs: gone at once, and its daemon stops.
        await cluster.kubectl("apply", "--validate=false", "-f", str(manifest(tmp_path, "brief")))
        await wait_for(lambda: daemon_rounds("brief") is not None, 10, "brief's health rounds")
        assert finalizers(cluster, "brief") == []
        await cluster.kubectl("delete", "llmd", "brief", "--timeout=10s", timeout=20)
        await wait_for(lambda: daemon_rounds("brief") is None, 10, "brief's daemon to stop")
        await asyncio.sleep(2.5)  # two more health intervals: no round of a deleted object
        assert daemon_rounds("brief") is None
        assert finalizers(cluster, "llama") == []  # and none came back
    # The deletion handler ran for the one deletion, not for every other event (status writes).
    notices = [r for r in caplog.records if "notice_deletion" in r.getMessage()]
    assert [getattr(r, "k8s_ref", {}).get("name") for r in notices] == ["brief"], notices

    # The operator is gone (uninstalled): deleting still completes, the children follow.
    await cluster.kubectl("delete", "llmd", "llama", "--timeout=10s", timeout=20)
    assert cluster.get(LLMD, "llama") is None
    await wait_for(lambda: children(cluster, "llama") == [], 10, "llama's children collected")


async def test_a_supervisor_whose_object_is_gone_stops_at_its_status_write(cluster: Cluster) -> None:
    # Deleted while the operator's watch was away (no DELETED event ever comes): the daemon's next
    # status write finds the object gone, and the daemon ends instead of retrying forever.
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(replicas=0, frontends=0)
    body = {**doc, "metadata": {**doc["metadata"], "uid": "gone-uid", "generation": 1}, "status": {}}
    kube = await Kube.connect(str(cluster.kubeconfig))
    async with httpx.AsyncClient() as http:
        supervisor = Supervisor(
            kube=kube,
            http=http,
            resolver=health.pod_address,
            metrics=metrics(),
            post_event=lambda *_: None,
            logger=logging.getLogger("test"),
        )
        try:
            with pytest.raises(OwnerGone, match="default/llama"):
                await supervisor.tick(body)
        finally:
            supervisor.close()
            await kube.close()
