"""The pods the operator renders, run by the test kubelet: worker pods run the image's real
`sshd -De` with the operator's SSH key pair, and mpirun in a launcher-like pod (the rendered
launcher pod with mpirun as its command) starts the ranks in the worker pods over SSH, by the
DNS names of the hostfile the operator wrote, as the image's non-root user. Each worker made its
own host key when it started (the image has none), and its sshd refuses root."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from berth.operator import credentials, naming, render
from berth.operator.crd_model import parse_spec
from berth.operator.kube import resource_path
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.kubelet import Kubelet

SUPPORT = Path(__file__).resolve().parents[1] / "support"
LLMDS = "/apis/berth.dev/v1alpha1/namespaces/default/llmdeployments"


def path_of(obj: dict[str, Any]) -> str:
    return resource_path(obj["apiVersion"], obj["kind"], "default")


def phase(cluster: Cluster, name: str) -> str | None:
    return ((cluster.get("v1/pods", name) or {}).get("status") or {}).get("phase")


def ready(cluster: Cluster, name: str) -> bool:
    conditions = ((cluster.get("v1/pods", name) or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


async def run(*argv: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    out, _ = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode is not None
    return process.returncode, out.decode()


@pytest.mark.slow  # mpirun over ssh into worker pods on the test kubelet
async def test_mpirun_starts_the_ranks_in_the_worker_pods_over_ssh(
    cluster: Cluster, controllers: ClusterSim, kubelet: Kubelet, tmp_path: Path
) -> None:
    # An LLMDeployment to own the children (no operator runs here: the renderer's output is
    # applied as it is, so the garbage collector keeps it).
    raw_spec = {
        "model": {"path": "/models/none"},
        "image": "berth:test",
        "tensorParallelSize": 2,
        "gpusPerNode": 0,
    }
    parent = await cluster.api(
        "POST",
        LLMDS,
        {
            "apiVersion": "berth.dev/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": "mpi"},
            "spec": raw_spec,
        },
    )
    owner = render.Owner(name="mpi", namespace="default", uid=parent["metadata"]["uid"])
    spec = parse_spec(raw_spec, "mpi")
    key_pair = credentials.new_ssh_key_pair("mpi")
    secrets = [
        render.ssh_secret(owner, key_pair),
        render.engine_key_secret(owner, credentials.new_engine_key()),
        render.admin_token_secret(owner, credentials.new_admin_token()),
    ]
    launcher_host = naming.launcher_host("mpi", "default", 0)
    ssh = str(SUPPORT / "mpi_ssh.sh")
    mpirun = [
        "mpirun", "-launcher", "ssh", "-launcher-exec", ssh,
        # The workers' proxies call back to the launcher by its DNS name, not the machine's.
        "-localhost", launcher_host,
        "-f", naming.HOSTFILE_PATH, "-n", "2", "-genv", "BERTH_PROBE", "forwarded",
        sys.executable, str(SUPPORT / "mpi_probe.py"),
    ]  # fmt: skip
    # The launcher starts with its workers: it waits until each one's sshd lets it in (pods of
    # one world start in any order), then runs mpirun. `berth launch` has to do the same.
    wait_for_workers = (
        f"for host in $(cut -d: -f1 {naming.HOSTFILE_PATH}); do "
        f"until {ssh} -o ConnectTimeout=2 $host true; do sleep 0.2; done; done"
    )
    command = ["sh", "-c", f'{wait_for_workers} && exec "$@"', "launcher", *mpirun]
    for child in [*secrets, *render.world_children(owner, spec, 0)]:
        if child["kind"] == "Pod":
            # The rendered launcher pod (user, volumes, hostname, env), running mpirun instead of
            # `berth launch` and without the engine's HTTP probes.
            (container,) = child["spec"]["containers"]
            container["command"] = command
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                del container[probe]
        await cluster.api("POST", path_of(child), child)

    await wait_for(lambda: phase(cluster, "mpi-w0-launcher") in ("Succeeded", "Failed"), 90, "mpirun to end")
    launcher_log = next(e for e in kubelet.executions if e.pod == "mpi-w0-launcher").log_tail(200)
    assert phase(cluster, "mpi-w0-launcher") == "Succeeded", launcher_log
    lines = sorted(line for line in launcher_log.splitlines() if line.startswith("rank "))
    assert lines == [
        "rank 0 of 2 on mpi-w0-0 uid=1000 probe=forwarded sum=1",
        "rank 1 of 2 on mpi-w0-1 uid=1000 probe=forwarded sum=1",
    ], launcher_log

    # The workers: the rendered command, sshd as root with the operator's key, Ready by its
    # tcpSocket probe on the ssh port, the hostfile's names resolving to their pod IPs.
    for worker in ("mpi-w0-0", "mpi-w0-1"):
        await wait_for(lambda: ready(cluster, worker), 30, f"{worker} Ready")  # noqa: B023
        (sshd,) = [e for e in kubelet.executions if e.pod == worker]
        assert sshd.argv == list(render.WORKER_COMMAND) and sshd.exit_code is None
        address = (cluster.get("v1/pods", worker) or {})["status"]["podIP"]
        assert kubelet.resolve("default", naming.worker_host("mpi", "default", 0, int(worker[-1]))) == address
    assert (
        kubelet.resolve("default", launcher_host)
        == cluster.get("v1/pods", "mpi-w0-launcher")["status"]["podIP"]
    )

    # Each worker's own host key, made at its start; the launcher's key lets in the image's user,
    # never root.
    key = tmp_path / "id_ed25519"
    key.write_text(key_pair.private_openssh)
    key.chmod(0o600)
    ssh_options = ["-i", str(key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    ssh_options += ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR"]
    host_keys = set()
    for worker in ("mpi-w0-0", "mpi-w0-1"):
        address = (cluster.get("v1/pods", worker) or {})["status"]["podIP"]
        code, scanned = await run("ssh-keyscan", "-t", "ed25519", "-T", "5", address)
        assert code == 0 and "ssh-ed25519" in scanned, scanned
        host_keys.add(scanned.split()[-1])
        assert (await run("ssh", *ssh_options, f"berth@{address}", "id -u"))[1].strip() == "1000"
        assert (await run("ssh", *ssh_options, f"root@{address}", "id -u"))[0] != 0
        # The worker holds no private key: only the public half it lets in.
        listed = (await run("ssh", *ssh_options, f"berth@{address}", f"ls -A {naming.SSH_DIR}"))[1]
        assert listed.split() == [render.SSH_AUTHORIZED_KEYS]
    assert len(host_keys) == 2
