"""The test cluster's kubelet (tests/support/kubelet.py) runs pods for real: processes in their
own network, mount and UTS namespaces, with the pod's env, volumes, user, probes and deletion
semantics. Every test here talks to it only through the API, as the operator does."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support import pod_network
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.image import Image
from tests.support.kubelet import Kubelet
from tests.support.pod_state import processes_in

PODS = "/api/v1/namespaces/default/pods"
WORK = {"name": "work", "mountPath": "/work"}


def pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    labels = spec.pop("labels", {"app": name})
    container = {"name": "main", "image": "berth:test", "command": command, **spec.pop("container", {})}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {"containers": [container], **spec},
    }


def status(cluster: Cluster, name: str) -> dict[str, Any]:
    return (cluster.get("v1/pods", name) or {}).get("status") or {}


def container_state(cluster: Cluster, name: str) -> dict[str, Any]:
    statuses = status(cluster, name).get("containerStatuses") or [{}]
    return statuses[0]


def is_ready(cluster: Cluster, name: str) -> bool:
    conditions = {c["type"]: c["status"] for c in status(cluster, name).get("conditions") or []}
    return conditions.get("Ready") == "True"


def log_of(kubelet: Kubelet, name: str) -> str:
    runs = [e for e in kubelet.executions if e.pod == name]
    return runs[-1].log.read_text() if runs else ""


async def create(cluster: Cluster, *objects: dict[str, Any]) -> None:
    for obj in objects:
        plural = {"Pod": "pods", "Service": "services", "Secret": "secrets", "ConfigMap": "configmaps"}[
            obj["kind"]
        ]
        await cluster.api("POST", f"/api/v1/namespaces/default/{plural}", obj)


SECRET = {
    "apiVersion": "v1",
    "kind": "Secret",
    "metadata": {"name": "creds", "namespace": "default"},
    "data": {"token": base64.b64encode(b"s3cret").decode(), "key": base64.b64encode(b"private").decode()},
}
CONFIG = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {"name": "conf", "namespace": "default"},
    "data": {"greeting": "hello from a ConfigMap\n"},
}
HEADLESS = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "grp", "namespace": "default"},
    "spec": {"clusterIP": "None", "selector": {"group": "grp"}, "publishNotReadyAddresses": True},
}
# What the first container reports about itself, then it serves HTTP (its readiness probe).
REPORT = (
    "echo hostname=$(hostname); echo uid=$(id -u) groups=$(id -G); echo token=$TOKEN ip=$POD_IP; "
    "cat /etc/berth/conf/greeting; stat -c 'key=%a:%g' /etc/berth/creds/key; "
    # DNS names appear once the kubelet has seen both pods running (as endpoints do).
    "until getent hosts beta.grp.default.svc >/dev/null; do sleep 0.1; done; "
    "echo dns $(getent hosts alpha.grp.default.svc) / $(getent hosts beta.grp.default.svc); "
    "echo home=$HOME; test -e /dev/shm/.probe || touch /dev/shm/.probe && echo shm=ok; "
    "touch /tmp/private-$(hostname); echo tmp=$(ls /tmp); "
    "exec python3 -m http.server 8080 --bind 0.0.0.0"
)


def reporting_pod(name: str, hostname: str) -> dict[str, Any]:
    return pod(
        name,
        ["sh", "-c", REPORT],
        labels={"group": "grp", "app": name},
        hostname=hostname,
        subdomain="grp",
        securityContext={"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000, "runAsNonRoot": True},
        volumes=[
            {"name": "creds", "secret": {"secretName": "creds", "defaultMode": 0o400}},
            {"name": "conf", "configMap": {"name": "conf"}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ],
        container={
            "env": [
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            ],
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
            "volumeMounts": [
                {"name": "creds", "mountPath": "/etc/berth/creds", "readOnly": True},
                {"name": "conf", "mountPath": "/etc/berth/conf"},
                {"name": "shm", "mountPath": "/dev/shm"},
            ],
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        },
    )


async def test_pods_run_in_their_own_namespaces_with_their_env_volumes_user_and_names(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    await create(
        cluster,
        SECRET,
        CONFIG,
        HEADLESS,
        reporting_pod("alpha-pod", "alpha"),
        reporting_pod("beta-pod", "beta"),
    )
    await wait_for(
        lambda: is_ready(cluster, "alpha-pod") and is_ready(cluster, "beta-pod"), 60, "both pods Ready"
    )

    alpha, beta = status(cluster, "alpha-pod"), status(cluster, "beta-pod")
    assert alpha["phase"] == "Running" and alpha["podIP"] != beta["podIP"]
    assert kubelet.network is not None and alpha["hostIP"] == kubelet.network.gateway
    assert container_state(cluster, "alpha-pod")["ready"] is True
    # Its own IP on the test bridge, reachable from this process like from a node.
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"http://{alpha['podIP']}:8080/", timeout=5)).status_code == 200
    log = log_of(kubelet, "alpha-pod")
    assert "hostname=alpha" in log
    assert "uid=1000 groups=1000" in log  # runAsUser, runAsGroup; fsGroup joins the groups
    assert f"token=s3cret ip={alpha['podIP']}" in log
    assert "hello from a ConfigMap" in log
    # A 0400 Secret file is group-readable by fsGroup (the kubelet's volume ownership).
    assert "key=440:1000" in log
    # Its own and the other pod's DNS names resolve to their IPs.
    assert f"dns {alpha['podIP']} alpha.grp.default.svc" in log, log
    assert f"/ {beta['podIP']} beta.grp.default.svc" in log, log
    assert "home=/home/berth" in log and "shm=ok" in log, log
    # Its own /tmp: its file, and none of the machine's but the checkout and venv the kubelet binds
    # back in where they lie under /tmp (a clone in /tmp).
    listed = next(line for line in log.splitlines() if line.startswith("tmp=")).removeprefix("tmp=").split()
    bound = {Path(path).relative_to("/tmp").parts[0] for path in kubelet.image.under_machine_tmp}
    assert set(listed) - bound == {"private-alpha"} and not Path("/tmp/private-alpha").exists(), listed
    # Nothing of the pods' files shows on the machine.
    assert not Path("/etc/berth").exists()
    assert "alpha.grp" not in Path("/etc/hosts").read_text()
    # Two network namespaces, one per pod, each process in its pod's.
    assert len(kubelet.netns_names()) == 2
    (pid,) = [
        p for p in kubelet.processes("alpha-pod") if "http.server" in Path(f"/proc/{p}/cmdline").read_text()
    ]
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    assert os.stat(f"/proc/{pid}").st_uid == 1000


async def test_phase_and_exit_codes_follow_the_processes(cluster: Cluster, kubelet: Kubelet) -> None:
    await create(
        cluster,
        pod(
            "fails",
            ["sh", "-c", "echo about to fail >&2; exit 3"],
            restartPolicy="Never",
            container={"terminationMessagePolicy": "FallbackToLogsOnError"},
        ),
        pod("succeeds", ["true"], restartPolicy="Never"),
        pod(
            "missing",
            ["no-such-command", "--flag"],
            restartPolicy="Never",
            container={"terminationMessagePolicy": "FallbackToLogsOnError"},
        ),
        pod("crashes", ["sh", "-c", "sleep 0.2; exit 7"], restartPolicy="Always"),
        # Init containers run one by one, to completion, before the pod's container.
        pod(
            "initialised",
            ["cat", "/work/order"],
            restartPolicy="Never",
            volumes=[{"name": "work", "emptyDir": {}}],
            initContainers=[
                {
                    "name": f"init-{n}",
                    "command": ["sh", "-c", f"echo {n} >> /work/order"],
                    "volumeMounts": [WORK],
                }
                for n in ("one", "two")
            ],
            container={"volumeMounts": [WORK]},
        ),
        pod(
            "init-fails",
            ["true"],
            restartPolicy="Never",
            initContainers=[{"name": "init", "command": ["sh", "-c", "exit 4"]}],
        ),
    )
    await wait_for(lambda: status(cluster, "fails").get("phase") == "Failed", 30, "fails Failed")
    terminated = container_state(cluster, "fails")["state"]["terminated"]
    assert terminated["exitCode"] == 3 and terminated["reason"] == "Error"
    assert terminated["message"].strip() == "about to fail"
    await wait_for(lambda: status(cluster, "succeeds").get("phase") == "Succeeded", 30, "succeeds Succeeded")
    assert container_state(cluster, "succeeds")["state"]["terminated"]["reason"] == "Completed"
    await wait_for(lambda: status(cluster, "missing").get("phase") == "Failed", 30, "missing Failed")
    missing = container_state(cluster, "missing")["state"]["terminated"]
    assert missing["exitCode"] == 127 and "no-such-command" in missing["message"]
    # restartPolicy Always: restarted at once, the pod stays Running, the last exit remembered.
    await wait_for(lambda: container_state(cluster, "crashes").get("restartCount", 0) >= 1, 30, "a restart")
    crashed = container_state(cluster, "crashes")
    assert status(cluster, "crashes")["phase"] == "Running"
    assert crashed["lastState"]["terminated"]["exitCode"] == 7
    await wait_for(lambda: status(cluster, "initialised").get("phase") == "Succeeded", 30, "initialised done")
    assert log_of(kubelet, "initialised").split() == ["one", "two"]
    assert [
        c["state"]["terminated"]["exitCode"] for c in status(cluster, "initialised")["initContainerStatuses"]
    ] == [0, 0]
    await wait_for(lambda: status(cluster, "init-fails").get("phase") == "Failed", 30, "init-fails Failed")
    (init,) = status(cluster, "init-fails")["initContainerStatuses"]
    assert init["state"]["terminated"]["exitCode"] == 4
    assert [e.container for e in kubelet.executions if e.pod == "init-fails"] == ["init"]  # never started
    conditions = {c["type"]: c["status"] for c in status(cluster, "init-fails")["conditions"]}
    assert conditions["Initialized"] == "False"


async def test_probes_drive_ready_and_kill(cluster: Cluster, kubelet: Kubelet, tmp_path: Path) -> None:
    # The probes test files the test itself adds and removes (through a hostPath volume), so
    # each step waits on the test, never on a timer a loaded machine could overrun.
    cues = tmp_path / "cues"
    cues.mkdir()
    (cues / "alive").touch()
    await create(
        cluster,
        pod(
            "probed",
            ["sleep", "120"],
            restartPolicy="Never",
            volumes=[{"name": "cues", "hostPath": {"path": str(cues)}}],
            container={
                "volumeMounts": [{"name": "cues", "mountPath": "/cues"}],
                "readinessProbe": {
                    "exec": {"command": ["test", "-e", "/cues/ready"]},
                    "periodSeconds": 1,
                    "timeoutSeconds": 5,
                    "failureThreshold": 1,
                },
                "livenessProbe": {
                    "exec": {"command": ["test", "-e", "/cues/alive"]},
                    "periodSeconds": 1,
                    "timeoutSeconds": 5,
                    "failureThreshold": 2,
                    "initialDelaySeconds": 1,
                },
            },
        ),
        pod(
            "never-starts",
            ["sleep", "60"],
            restartPolicy="Never",
            container={"startupProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 2}},
        ),
    )
    await wait_for(lambda: status(cluster, "probed").get("phase") == "Running", 60, "probed Running")
    assert not is_ready(cluster, "probed")
    (cues / "ready").touch()
    await wait_for(lambda: is_ready(cluster, "probed"), 60, "probed Ready once /cues/ready exists")
    (cues / "ready").unlink()
    await wait_for(lambda: not is_ready(cluster, "probed"), 60, "probed not Ready once /cues/ready is gone")
    assert status(cluster, "probed").get("phase") == "Running"
    (cues / "alive").unlink()
    try:
        await wait_for(
            lambda: status(cluster, "probed").get("phase") == "Failed", 60, "killed by its liveness probe"
        )
    except AssertionError as error:  # this has failed now and then: say what the kubelet knew
        runs = [(e.pod, e.exit_code, e.killed_by) for e in kubelet.executions]
        container = kubelet.runtime("probed").containers[0]
        process = container.process
        raise AssertionError(
            f"{error}; status {status(cluster, 'probed')}; executions {runs}; problems {kubelet.problems}; "
            f"kill reason {container.kill_reason}; main process {process and process.pid} returncode "
            f"{process and process.returncode}; at {time.monotonic():.2f} probes {list(container.probe_log)}"
        ) from None
    assert container_state(cluster, "probed")["state"]["terminated"]["exitCode"] == 137
    assert [e.killed_by for e in kubelet.executions if e.pod == "probed"] == ["liveness probe"]
    await wait_for(
        lambda: status(cluster, "never-starts").get("phase") == "Failed", 30, "startup probe gave up"
    )
    assert [e.killed_by for e in kubelet.executions if e.pod == "never-starts"] == ["startup probe"]
    assert not is_ready(cluster, "never-starts")


async def test_deletion_is_sigterm_then_the_grace_period_then_sigkill(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    polite = "trap 'echo got TERM; exit 0' TERM; while true; do sleep 0.1; done"
    stubborn = "trap 'echo ignoring TERM' TERM; sleep 300 & while true; do sleep 0.1; done"
    await create(
        cluster,
        pod("polite", ["sh", "-c", polite], terminationGracePeriodSeconds=30),
        pod("stubborn", ["sh", "-c", stubborn], terminationGracePeriodSeconds=2),
    )
    await wait_for(lambda: is_ready(cluster, "polite") and is_ready(cluster, "stubborn"), 30, "both Running")
    polite_pids = kubelet.processes("polite")
    stubborn_pids = kubelet.processes("stubborn")
    assert len(stubborn_pids) >= 2  # the shell and its background sleep
    started = time.monotonic()
    await cluster.api("DELETE", f"{PODS}/polite")
    await cluster.api("DELETE", f"{PODS}/stubborn")
    # Graceful: the pods stay, terminating, until the kubelet confirms.
    assert cluster.get("v1/pods", "stubborn")["metadata"]["deletionGracePeriodSeconds"] == 2
    await wait_for(lambda: cluster.get("v1/pods", "polite") is None, 30, "polite gone")
    polite_seconds = time.monotonic() - started
    await wait_for(lambda: cluster.get("v1/pods", "stubborn") is None, 30, "stubborn gone")
    stubborn_seconds = time.monotonic() - started
    assert polite_seconds < 2 <= stubborn_seconds, (polite_seconds, stubborn_seconds)
    assert "got TERM" in log_of(kubelet, "polite") and "ignoring TERM" in log_of(kubelet, "stubborn")
    for pid in polite_pids + stubborn_pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert kubelet.netns_names() == []


async def test_services_resolve_to_ready_endpoints(cluster: Cluster, kubelet: Kubelet) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080}]},
    }
    server = pod(
        "web-1",
        ["python3", "-m", "http.server", "8080"],
        labels={"app": "web"},
        container={"readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}},
    )
    client = pod(
        "client",
        [
            "sh",
            "-c",
            "until getent hosts web.default.svc; do sleep 0.2; done; "
            "python3 -c \"import urllib.request as u; print(u.urlopen('http://web.default.svc:8080/').status)\"",
        ],
        restartPolicy="Never",
    )
    await create(cluster, service, server, client)
    await wait_for(lambda: status(cluster, "client").get("phase") == "Succeeded", 60, "the client's request")
    assert "200" in log_of(kubelet, "client")
    assert kubelet.resolve("default", "web.default.svc") == status(cluster, "web-1")["podIP"]


async def test_a_stopped_kubelet_leaves_nothing_behind(
    cluster: Cluster, pod_image: Image, tmp_path: Path
) -> None:
    kubelet = Kubelet(cluster.server, tmp_path / "node", pod_image)
    async with kubelet.running(), ClusterSim(cluster, fake_kubelet=False).running():
        await create(cluster, pod("sleeper", ["sh", "-c", "sleep 300 & sleep 300"]))
        await wait_for(lambda: is_ready(cluster, "sleeper"), 30, "sleeper Running")
        pids = kubelet.processes("sleeper")
        namespaces = kubelet.netns_names()
        mount_namespace = kubelet.runtime("sleeper").containers[0].mount_namespace
        bridge = kubelet.network.bridge  # type: ignore[union-attr]
    await asyncio.sleep(0)
    assert pids and namespaces
    assert processes_in(mount_namespace) == []  # type: ignore[arg-type]
    for name in namespaces:
        assert not (pod_network.NETNS_DIR / name).exists()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert bridge not in links and f"{pod_network.LINK_PREFIX}v{os.getpid():x}" not in links
    assert not (tmp_path / "node").exists()
