"""`berth operator` as a process, the way the Deployment runs it: it takes the Lease, serves
kopf's liveness endpoint and Prometheus metrics, reconciles, and stops cleanly on SIGTERM,
giving the Lease up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import Cluster, wait_for
from tests.support.engine_endpoint import free_ports

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"


async def answers(url: str, needle: str = "") -> bool:
    with contextlib.suppress(httpx.HTTPError):
        async with httpx.AsyncClient() as client:
            response = await client.get(url, timeout=1.0)
            return response.status_code == 200 and needle in response.text
    return False


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_berth_operator_process_serves_liveness_metrics_and_reconciles(cluster: Cluster) -> None:
    metrics_port, liveness_port = free_ports(2)
    liveness = f"http://127.0.0.1:{liveness_port}/healthz"
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    counted = 'berth_operator_reconciles_total{result="success"} 1.0'
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("berth")), "operator",
        "--namespace", "default", "--kubeconfig", str(cluster.kubeconfig),
        "--metrics-port", str(metrics_port), "--liveness", liveness,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await wait_for(lambda: answers(liveness), 30, "kopf's liveness endpoint")
        await cluster.kubectl("apply", "--validate=false", "-f", str(EXAMPLES / "llmdeployment-cpu.yaml"))
        await wait_for(
            lambda: cluster.get("apps/v1/statefulsets", "tiny-w0"), 20, "the operator's StatefulSet"
        )
        await wait_for(lambda: answers(metrics, counted), 10, "the reconcile counted in /metrics")
        # The series the operator's own code moved, under the names its docs give them.
        async with httpx.AsyncClient() as client:
            exposition = (await client.get(metrics, timeout=5)).text
        assert "berth_operator_reconcile_duration_seconds_count 1.0" in exposition
        await wait_for(lambda: answers(metrics, "berth_operator_worlds{phase="), 20, "the worlds by phase")
    finally:
        if process.returncode is None:
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 15)
        except TimeoutError:
            process.kill()
            await process.wait()
        stderr = (await process.stderr.read()).decode()
    assert process.returncode == 0, stderr[-3000:]
    # It led through the Lease (outside a pod, without $POD_NAMESPACE: in namespace default)
    # and, stopping cleanly, gave it up: a standby would take over at once, not after it expires.
    lease = cluster.get("coordination.k8s.io/v1/leases", "berth-operator", "default")
    assert lease is not None and lease["spec"].get("leaseTransitions") == 0
    assert not lease["spec"].get("holderIdentity"), lease
    worker = cluster.get("apps/v1/statefulsets", "tiny-w0")["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in str(worker["resources"])  # gpusPerNode 0: a CPU world
