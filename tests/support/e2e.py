"""End to end: an applied manifest, the real operator, the cluster's controllers and the real
kubelet, so that every pod the operator renders runs its rendered command.

    async with deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        await llmd.wait(lambda: llmd.world().get("phase") == "Ready", 120, "the world Ready")
        url = llmd.openai_url()           # a ready endpoint's pod IP, as the Service routes

`tiny_cpu_example()` is manifests/examples/llmdeployment-cpu.yaml pointed at a tiny checkpoint
on this machine (a hostPath volume, as on a one-node cluster). `rendered_commands()` is every
container command the renderer can emit for a spec, for the renderer-coverage test.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from berth.operator import naming, render
from berth.operator.crd_model import parse_spec
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.image import Image
from tests.support.kubelet import Kubelet
from tests.support.operator_runner import running_operator
from tests.support.pod_state import Execution
from tests.support.scheduler import Scheduler

REPO = Path(__file__).resolve().parents[2]
CPU_EXAMPLE = REPO / "manifests" / "examples" / "llmdeployment-cpu.yaml"
LLMD = "berth.dev/v1alpha1/llmdeployments"
# Fast polls and a small restart budget: a world that fails is given up on within seconds.
FAST_HEALTH = dict(
    intervalSeconds=1,
    timeoutSeconds=1,
    maxRestarts=1,
    backoffSeconds=1,
    maxBackoffSeconds=1,
    startupTimeoutSeconds=120,
)


@contextlib.asynccontextmanager
async def running_kubelet(
    cluster: Cluster, image: Image, tmp_path: Path, scheduler: Scheduler | None = None
) -> AsyncIterator[Kubelet]:
    """The test kubelet (under `scheduler`: it runs the pods the scheduler bound, on their
    nodes); everything it made is gone afterwards, and pods it refused fail the test."""
    kubelet = Kubelet(cluster.server, tmp_path / "node", image, scheduler=scheduler)
    async with kubelet.running():
        yield kubelet
    assert not kubelet.problems, f"the test kubelet refused pods: {kubelet.problems}"


def shareable_copy(model: Path, into: Path) -> Path:
    """A copy of a checkpoint that the pods' non-root user can read (pytest's temporary
    directories are private to root, as a node's files may be to its pods)."""
    target = into / model.name
    shutil.copytree(model, target)
    readable(into)
    return target


def readable(path: Path) -> Path:
    """`path` and everything under it readable by every user (the pods' user among them)."""
    for directory, _, files in os.walk(path):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(Path(directory) / name, 0o644)
    return path


def tiny_cpu_example(model: Path, **spec: Any) -> dict[str, Any]:
    """The CPU example with `model` (a directory) mounted where the example expects its model:
    hostPath = the model's parent directory, mounted at the example's /models."""
    doc = yaml.safe_load(CPU_EXAMPLE.read_text())
    volume = doc["spec"]["model"]["volume"]
    volume["hostPath"]["path"] = str(model.parent)
    doc["spec"]["model"]["path"] = f"{volume['mountPath']}/{model.name}"
    doc["spec"].update(copy.deepcopy(spec))
    return doc


@dataclass
class Deployed:
    cluster: Cluster
    kubelet: Kubelet
    name: str
    namespace: str = "default"

    def get(self) -> dict[str, Any]:
        return self.cluster.get(LLMD, self.name, self.namespace) or {}

    def status(self) -> dict[str, Any]:
        return self.get().get("status") or {}

    def world(self, index: int = 0) -> dict[str, Any]:
        worlds = self.status().get("worlds") or []
        return next((world for world in worlds if world.get("index") == index), {})

    def condition(self, kind: str) -> dict[str, Any]:
        return next((c for c in self.status().get("conditions") or [] if c["type"] == kind), {})

    def events(self, reason: str) -> list[str]:
        return [
            event.get("message", "")
            for event in self.cluster.objects("v1/events", self.namespace)
            if event.get("reason") == reason and event.get("involvedObject", {}).get("name") == self.name
        ]

    def pod(self, name: str) -> dict[str, Any]:
        return self.cluster.get("v1/pods", name, self.namespace) or {}

    def pod_status(self, name: str) -> dict[str, Any]:
        return self.pod(name).get("status") or {}

    def pod_ready(self, name: str) -> bool:
        conditions = self.pod_status(name).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def terminated(self, name: str) -> dict[str, Any]:
        """The pod's container's last termination (state or lastState), or {}."""
        for container in self.pod_status(name).get("containerStatuses") or []:
            for key in ("state", "lastState"):
                terminated = (container.get(key) or {}).get("terminated")
                if terminated:
                    return terminated
        return {}

    def executions(self, role: str | None = None) -> list[Execution]:
        prefix = f"{self.name}-w"
        return [
            execution
            for execution in self.kubelet.executions
            if execution.pod.startswith(prefix) and (role is None or execution.role == role)
        ]

    def endpoints(self) -> list[str]:
        """Pod IPs of the ready pods the deployment's Service selects (its endpoints)."""
        service = self.cluster.get("v1/services", naming.service_name(self.name), self.namespace) or {}
        selector = (service.get("spec") or {}).get("selector") or {}
        return [
            pod["status"]["podIP"]
            for pod in self.cluster.objects("v1/pods", self.namespace)
            if selector
            and all((pod["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
            and self.pod_ready(pod["metadata"]["name"])
        ]

    def nodes(self) -> dict[str, str]:
        """Pod -> node of the deployment's pods that are bound to a node and not going away."""
        return {
            pod["metadata"]["name"]: pod["spec"]["nodeName"]
            for pod in self.cluster.objects("v1/pods", self.namespace)
            if (pod["metadata"].get("labels") or {}).get(naming.DEPLOYMENT) == self.name
            and pod["spec"].get("nodeName")
            and not pod["metadata"].get("deletionTimestamp")
        }

    async def complete(self, prompt: str = "the quick brown fox", max_tokens: int = 8) -> str:
        """A greedy completion through a ready endpoint of the Service (its text)."""
        request = {
            "model": self.get()["spec"]["model"]["path"],
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        async with httpx.AsyncClient() as client:
            reply = await client.post(f"{self.openai_url()}/completions", json=request, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    def openai_url(self) -> str:
        """The OpenAI base URL through a ready endpoint of the Service (what kube-proxy routes)."""
        endpoints = self.endpoints()
        assert endpoints, f"the Service {self.name} has no ready endpoint"
        return f"http://{endpoints[0]}:{naming.ENGINE_PORT}/v1"

    async def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        return await wait_for(predicate, timeout, what, interval=0.1)

    async def delete(self) -> None:
        await self.cluster.kubectl("delete", "llmd", self.name, "--timeout=60s", timeout=90)


async def apply(cluster: Cluster, kubelet: Kubelet, manifest: dict[str, Any], tmp_path: Path) -> Deployed:
    """`kubectl apply` of `manifest`."""
    path = tmp_path / f"{manifest['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    await cluster.kubectl("apply", "--validate=false", "-f", str(path))
    return Deployed(cluster, kubelet, manifest["metadata"]["name"], cluster.namespace)


@contextlib.asynccontextmanager
async def deployed(
    cluster: Cluster,
    kubelet: Kubelet,
    manifest: dict[str, Any],
    tmp_path: Path,
    scheduler: Scheduler | None = None,
    **memo: Any,
) -> AsyncIterator[Deployed]:
    """`kubectl apply` of `manifest` with the operator (polling pod IPs, as in a cluster), the
    StatefulSet / Deployment controllers and the garbage collector running (and `scheduler`
    binding pods to its nodes), the kubelet running every pod. On the way out the operator stops
    first, then the controllers."""
    sim = ClusterSim(cluster, fake_kubelet=False, scheduler=scheduler)
    async with sim.running(), running_operator(cluster, **memo):
        yield await apply(cluster, kubelet, manifest, tmp_path)


def rendered_commands(manifest: dict[str, Any], namespace: str = "default") -> dict[str, list[str]]:
    """Every container command the renderer emits for this manifest: role -> argv."""
    name = manifest["metadata"]["name"]
    owner = render.Owner(name=name, namespace=namespace, uid="coverage")
    commands: dict[str, list[str]] = {}
    for child in render.children(owner, parse_spec(manifest["spec"], name)):
        body = child.get("spec") or {}
        pod_spec = body if child["kind"] == "Pod" else body.get("template", {}).get("spec")
        if not pod_spec:
            continue
        labels = (
            child["metadata"]["labels"]
            if child["kind"] == "Pod"
            else child["spec"]["template"]["metadata"]["labels"]
        )
        for container in pod_spec.get("containers", []):
            argv = [*container.get("command", []), *container.get("args", [])]
            commands.setdefault(labels[naming.ROLE], argv)
    return commands
