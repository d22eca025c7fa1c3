"""A partition between the operator and a serving world: the operator asks the kubelet's opinion
before restarting what it cannot reach.

The real operator runs as its own process (leader election, kopf, pod IPs as in a cluster) in a
cgroup of its own; the test kubelet runs the world's pods in their network namespaces and probes
them from the node, as a kubelet does. An iptables rule matching the operator's cgroup drops its
traffic to the launcher pod (and nothing else's): for the whole cut the kubelet still finds the
launcher Ready, so the world is reported Unreachable (phase, condition, Event) and not
restarted; once the rule goes, the condition clears and the world is Ready again, in the same
pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import yaml

from berth.operator import naming
from tests.support import e2e
from tests.support.cluster import Cluster, ClusterSim
from tests.support.kubelet import Kubelet

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "operator_process.py"
CGROUPS = Path("/sys/fs/cgroup/unified")  # cgroup v2 (hybrid layout), which iptables matches on
HEALTH = {**e2e.FAST_HEALTH, "failureThreshold": 2}


@contextlib.contextmanager
def cgroup() -> Iterator[Path]:
    """A cgroup v2 of this test's own (removed after, its processes gone by then)."""
    path = CGROUPS / f"berth-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        for _ in range(100):
            with contextlib.suppress(OSError):
                path.rmdir()
                break
            subprocess.run(["sleep", "0.05"], check=False)


@contextlib.contextmanager
def cut_off(group: Path, address: str) -> Iterator[None]:
    """Drop (reject) every TCP packet the processes of `group` send to `address`."""
    rule = ["OUTPUT", "-p", "tcp", "-m", "cgroup", "--path", group.name, "-d", address, "-j", "REJECT"]
    subprocess.run(["iptables", "-I", *rule], check=True, timeout=30)
    try:
        yield
    finally:
        subprocess.run(["iptables", "-D", *rule], check=True, timeout=30)


@contextlib.asynccontextmanager
async def operator_in(group: Path, cluster: Cluster, log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    procs = group / "cgroup.procs"
    with log.open("wb") as output:
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), "--namespace", cluster.namespace,
            "--kubeconfig", str(cluster.kubeconfig), "--metrics-port", "0", "--liveness", "",
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=output, stderr=output,
            preexec_fn=lambda: procs.write_text(str(os.getpid())),
        )  # fmt: skip
    try:
        yield process
    finally:
        if process.returncode is None:
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 20)
        except TimeoutError:
            process.kill()
            await process.wait()


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_serving_world_the_operator_cannot_reach_is_reported_not_restarted(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    manifest = e2e.tiny_cpu_example(models, tensorParallelSize=1, health=HEALTH)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(manifest))
    llmd = e2e.Deployed(cluster, kubelet, manifest["metadata"]["name"], cluster.namespace)
    launcher = naming.launcher_pod_name(llmd.name, 0)
    interval = HEALTH["intervalSeconds"]
    with cgroup() as group:
        async with (
            ClusterSim(cluster, fake_kubelet=False).running(),
            operator_in(group, cluster, tmp_path / "operator.log"),
        ):
            await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "tiny.yaml"))
            await llmd.wait(lambda: llmd.world().get("phase") == "Ready", 120, "the world Ready")
            uid = llmd.pod(launcher)["metadata"]["uid"]
            with cut_off(group, llmd.pod_status(launcher)["podIP"]):
                await llmd.wait(
                    lambda: llmd.condition("Unreachable").get("status") == "True", 30, "Unreachable"
                )
                # Three more health intervals cut off: the kubelet's probes still pass.
                for _ in range(3):
                    await asyncio.sleep(interval)
                    assert llmd.pod_ready(launcher)
                    assert llmd.world().get("phase") == "Unreachable", llmd.world()
                    assert llmd.world().get("restarts", 0) == 0
                assert "reports its pod Ready: not restarted" in llmd.condition("Unreachable")["message"]
                assert llmd.events("WorldUnreachable")
            await llmd.wait(
                lambda: llmd.condition("Unreachable").get("status") == "False", 30, "the condition cleared"
            )
            await llmd.wait(lambda: llmd.world().get("phase") == "Ready", 30, "Ready again")
            assert llmd.pod(launcher)["metadata"]["uid"] == uid  # the same pod: never restarted
            assert llmd.world().get("restarts", 0) == 0
            assert llmd.events("WorldReachable")
            await llmd.delete()
