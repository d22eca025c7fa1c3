"""The rendered NetworkPolicies, enforced in the test network (tests/support/network_policy.py):
a two-rank world with a frontend comes up and serves with its ingress closed (mpirun's ssh,
hydra and the collectives within the world, the frontend's attach, the kubelet's probes all
pass), while a pod of another deployment reaches its OpenAI port and nothing else: not the
workers' sshd, not the launcher's attach or admin port, not the collective range.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from berth.operator import naming
from tests.operator.test_cluster_kubelet import create, pod
from tests.support import e2e
from tests.support.cluster import Cluster
from tests.support.kubelet import Kubelet
from tests.support.network_policy import Enforcer


def connects(netns: str, address: str, port: int) -> bool:
    """A TCP connection from inside `netns` (a pod's namespace) to address:port succeeds."""
    probe = f"exec 3<>/dev/tcp/{address}/{port}"
    result = subprocess.run(
        ["ip", "netns", "exec", netns, "timeout", "5", "bash", "-c", probe], capture_output=True, timeout=30
    )
    return result.returncode == 0


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_a_world_serves_behind_its_policies_and_another_deployment_reaches_only_its_api(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    manifest = e2e.tiny_cpu_example(models, tensorParallelSize=2, frontends=1, health=e2e.FAST_HEALTH)
    launcher = naming.launcher_pod_name("tiny", 0)
    async with (
        Enforcer(cluster, kubelet).running(),
        e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd,
    ):
        # Another deployment's pod, in the same namespace.
        intruder = pod(
            "intruder", ["sleep", "600"], labels={naming.DEPLOYMENT: "other", naming.ROLE: "launcher"}
        )
        await create(cluster, intruder)
        await llmd.wait(lambda: llmd.world().get("phase") == "Ready", 180, "the world Ready")
        frontend = next(p for p in cluster.names("v1/pods") if "-frontend-" in p)
        await llmd.wait(lambda: llmd.pod_ready(frontend), 120, "the frontend attached and Ready")
        await llmd.wait(lambda: llmd.pod_status("intruder").get("podIP"), 60, "the intruder running")
        policies = cluster.names("networking.k8s.io/v1/networkpolicies")
        assert policies == ["tiny-w0-frontend", "tiny-w0-launcher", "tiny-w0-worker"]

        # The world serves, through the launcher and through the frontend.
        async with httpx.AsyncClient() as client:
            for address in (llmd.pod_status(launcher)["podIP"], llmd.pod_status(frontend)["podIP"]):
                url = f"http://{address}:{naming.ENGINE_PORT}/v1"
                model = (await client.get(f"{url}/models", timeout=30)).json()["data"][0]["id"]
                reply = await client.post(
                    f"{url}/completions",
                    json={"model": model, "prompt": "hello", "max_tokens": 4},
                    timeout=60,
                )
                assert reply.status_code == 200, reply.text

        netns = kubelet.runtime("intruder").interface.netns
        launcher_ip = llmd.pod_status(launcher)["podIP"]
        worker_ip = llmd.pod_status("tiny-w0-0")["podIP"]
        assert connects(netns, launcher_ip, naming.ENGINE_PORT)  # a client: allowed
        assert not connects(netns, launcher_ip, naming.ATTACH_PORT)
        assert not connects(netns, launcher_ip, naming.ADMIN_PORT)
        assert not connects(netns, worker_ip, naming.SSH_PORT)
        # ... while the world's own launcher reaches its worker's sshd (mpirun's way in).
        assert connects(kubelet.runtime(launcher).interface.netns, worker_ip, naming.SSH_PORT)
        await llmd.delete()
