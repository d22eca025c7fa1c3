"""A test cluster: the fixed kmock emulator on 127.0.0.1, a kubeconfig, kubectl, and the
controllers no emulator plays, played here explicitly and visibly:

- `statefulset_controller()`: pods `<sts>-<ordinal>` from each StatefulSet's template
  (hostname + subdomain for stable DNS, owner reference to the StatefulSet), recreated when
  deleted, removed beyond `replicas`;
- `deployment_controller()`: pods `<deployment>-<hash>-<random>` from each Deployment's template;
- `kubelet()`: a stand-in kubelet: every new pod becomes Running with an IP; an optional hook
  "runs" launcher containers (tests start a real server per launcher pod) and stops them when the
  pod goes. With `fake_kubelet=False`, tests/support/kubelet.py runs the pods for real instead;
- `garbage_collector()`: deletes objects all of whose owners are gone (cascading).

Each is one pass that a test may call itself; `ClusterSim.running()` loops them in the
background. They act through the emulator's HTTP API, so the watchers see real events.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kmock

from berth.operator.kube import Kube
from tests.support.kube_emulator import Emulator, declare_resources

OPERATOR_USER_AGENT = Kube.USER_AGENT

logger = logging.getLogger(__name__)

KUBECONFIG_TEMPLATE = """\
apiVersion: v1
kind: Config
clusters:
- name: kmock
  cluster:
    server: {server}
contexts:
- name: kmock
  context:
    cluster: kmock
    user: kmock
    namespace: {namespace}
current-context: kmock
users:
- name: kmock
  user:
    token: test-token
"""


def write_kubeconfig(path: Path, server: str, namespace: str = "default") -> Path:
    path.write_text(KUBECONFIG_TEMPLATE.format(server=server, namespace=namespace))
    return path


async def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `predicate` (sync or async) until it returns something truthy; fail after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def sampling(sample: Callable[[], Any], interval: float) -> AsyncIterator[None]:
    """Calls `sample()` (awaited when it returns an awaitable) every `interval` seconds for as
    long as the block runs."""

    async def loop() -> None:
        while True:
            result = sample()
            if asyncio.iscoroutine(result):
                await result
            await asyncio.sleep(interval)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def resource_path(
    resource: Any, namespace: str | None, name: str | None = None, sub: str | None = None
) -> str:
    prefix = f"/apis/{resource.group}/{resource.version}" if resource.group else f"/api/{resource.version}"
    path = (
        f"{prefix}/namespaces/{namespace}/{resource.plural}" if namespace else f"{prefix}/{resource.plural}"
    )
    return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


@dataclass
class Cluster:
    emulator: Emulator
    server: str
    kubeconfig: Path
    cache_dir: Path
    session: aiohttp.ClientSession
    namespace: str = "default"

    # --- reading (in-process: the emulator's own store) -----------------------------------

    def objects(self, resource: str, namespace: str | None = "default") -> list[dict[str, Any]]:
        """Live objects of one resource ('v1/pods', 'apps/v1/statefulsets', ...), by name."""
        wanted = kmock.resource(resource)
        store = self.emulator.objects._objects
        keys = store.keys_of(wanted.group, wanted.version, wanted.plural)
        found = [
            store[key].raw
            for (ns, _), key in list(keys.items())
            if (namespace is None or ns == namespace) and not store[key].deleted
        ]
        return sorted(found, key=lambda obj: obj["metadata"]["name"])

    def get(self, resource: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        try:
            obj = self.emulator.objects[resource, namespace, name]
        except KeyError:
            return None
        return None if obj.deleted else obj.raw

    def names(self, resource: str, namespace: str = "default") -> list[str]:
        """The names of the live objects of one resource, sorted (read from the store's index:
        no copy of any object)."""
        wanted = kmock.resource(resource)
        store = self.emulator.objects._objects
        keys = store.keys_of(wanted.group, wanted.version, wanted.plural)
        return sorted(
            name for (ns, name), key in list(keys.items()) if ns == namespace and not store[key].deleted
        )

    def event_messages(self, reason: str) -> list[str]:
        """The messages of the Events with this reason, oldest first."""
        return [e.get("message", "") for e in self.objects("v1/events") if e.get("reason") == reason]

    def pruned_from_operator(self) -> list[tuple[str, str, str, str]]:
        """Fields of the operator's writes that the schema does not declare (a real API server
        drops them silently: the operator would lose them at its next restart)."""
        return [
            entry
            for entry in self.emulator.pruned
            if entry[3].startswith("kopf/") or entry[3] == OPERATOR_USER_AGENT
        ]

    def all_live(self) -> Iterator[tuple[Any, str | None, dict[str, Any]]]:
        for (res, ns, _), obj in list(self.emulator.objects.items()):
            if not obj.deleted:
                yield res, ns, obj.raw

    # --- writing (over HTTP, like any client) ---------------------------------------------

    async def api(self, method: str, path: str, body: Any = None, content_type: str | None = None) -> Any:
        headers = {"Content-Type": content_type} if content_type else {}
        if method == "PATCH" and not content_type:
            headers["Content-Type"] = "application/merge-patch+json"
        async with self.session.request(method, self.server + path, json=body, headers=headers) as response:
            payload = await response.json(content_type=None)
            if response.status >= 400:
                raise AssertionError(f"{method} {path}: HTTP {response.status}: {payload}")
            return payload

    @contextlib.asynccontextmanager
    async def kubectl_running(self, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
        """The real kubectl started in the background (e.g. `wait`); killed on exit if still running."""
        process = await asyncio.create_subprocess_exec(
            "kubectl",
            f"--kubeconfig={self.kubeconfig}",
            f"--cache-dir={self.cache_dir}",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            yield process
        finally:
            if process.returncode is None:
                process.kill()
            await process.wait()

    async def kubectl(self, *args: str, timeout: float = 30.0, check: bool = True) -> str:
        """Run the real kubectl against the emulator (async: the emulator shares this loop)."""
        process = await asyncio.create_subprocess_exec(
            "kubectl",
            f"--kubeconfig={self.kubeconfig}",
            f"--cache-dir={self.cache_dir}",
            "--request-timeout=20s",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise AssertionError(f"kubectl {' '.join(args)} did not finish in {timeout}s") from None
        if check and process.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({process.returncode}): {err.decode()}")
        return out.decode()


@contextlib.asynccontextmanager
async def running_cluster(tmp_path: Path, namespace: str = "default") -> AsyncIterator[Cluster]:
    """The emulator on 127.0.0.1 (free port), a kubeconfig for it, an HTTP session."""
    async with Emulator() as emulator, kmock.Server(emulator, host="127.0.0.1") as server:
        declare_resources(emulator, (namespace,))
        url = f"http://127.0.0.1:{server.port}"
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig.yaml", url, namespace)
        cache_dir = tmp_path / "kube-cache"
        cache_dir.mkdir(exist_ok=True)
        # A new connection per request, each bounded: an in-process kopf operator cancels, when it
        # stops, every task born during its run, the emulator's handlers of open keep-alive
        # connections among them; the next request on such a connection would wait forever.
        connector = aiohttp.TCPConnector(force_close=True)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            yield Cluster(emulator, url, kubeconfig, cache_dir, session, namespace)


PodHook = Callable[[dict[str, Any]], Awaitable[None]]
# The alphabet Kubernetes' controllers encode template hashes in (no vowels, no look-alikes).
_HASH_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def template_hash(template: dict[str, Any]) -> str:
    """A 10-character hash of a pod template, like controller-revision-hash / pod-template-hash."""
    digest = int(hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest(), 16)
    chars = []
    for _ in range(10):
        digest, index = divmod(digest, len(_HASH_ALPHABET))
        chars.append(_HASH_ALPHABET[index])
    return "".join(chars)


def _owner(kind: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _by_owner(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Owner uid -> the objects it owns (one pass: each controller looks its own up)."""
    owned: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        for ref in obj["metadata"].get("ownerReferences") or []:
            owned.setdefault(ref.get("uid"), []).append(obj)
    return owned


@dataclass
class ClusterSim:
    """The controllers a real cluster would have, and (unless a real kubelet runs the pods,
    tests/support/kubelet.py) a stand-in kubelet that marks every pod Running."""

    cluster: Cluster
    # Called when a pod starts "running" / when it is gone (e.g. start and stop an engine server).
    on_pod_start: PodHook | None = None
    on_pod_stop: PodHook | None = None
    interval: float = 0.05
    # False when tests/support/kubelet.py runs the pods for real.
    fake_kubelet: bool = True
    # tests/support/scheduler.py: nodes and a scheduler; the stand-in kubelet then runs only
    # bound pods (without one, every pod runs at once, as on a single node).
    scheduler: Any = None
    _ips: Iterator[int] = field(default_factory=lambda: itertools.count(10))
    _running_pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> pod
    failed_creates: list[str] = field(default_factory=list)  # what the API refused, as the Events say
    failed_passes: int = 0  # passes of the controllers that raised (logged, then retried)
    # (uid, generation) -> its template's hash: a template changes only with its owner's spec.
    _hashes: dict[tuple[str, Any], str] = field(default_factory=dict)
    # The garbage collector reads every object: it runs after a deletion, else every few passes.
    _collected_after: int = -1
    _passes: int = 0

    def _template_hash(self, owner: dict[str, Any]) -> str:
        meta = owner["metadata"]
        key = (meta["uid"], meta.get("generation"))
        if key not in self._hashes:
            self._hashes[key] = template_hash(owner["spec"]["template"])
        return self._hashes[key]

    async def _create_pod(self, owner_kind: str, owner: dict[str, Any], pod: dict[str, Any]) -> None:
        """Create a pod; a refusal becomes a FailedCreate Event on the owner, as the real
        controllers report it (and they retry, as this does on its next pass)."""
        namespace = owner["metadata"]["namespace"]
        try:
            await self.cluster.api("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
        except AssertionError as error:
            message = (
                f"create Pod {pod['metadata'].get('name') or pod['metadata'].get('generateName')} "
                f"in {owner_kind} {owner['metadata']['name']} failed: {error}"
            )
            if message not in self.failed_creates:
                await self.cluster.api(
                    "POST",
                    f"/api/v1/namespaces/{namespace}/events",
                    {
                        "apiVersion": "v1",
                        "kind": "Event",
                        "metadata": {"generateName": f"{owner['metadata']['name']}.", "namespace": namespace},
                        "involvedObject": {
                            "apiVersion": "apps/v1",
                            "kind": owner_kind,
                            "name": owner["metadata"]["name"],
                            "uid": owner["metadata"]["uid"],
                            "namespace": namespace,
                        },
                        "reason": "FailedCreate",
                        "message": message,
                        "type": "Warning",
                        "source": {"component": f"{owner_kind.lower()}-controller"},
                    },
                )
                # Noted once the Event exists: a test that saw this may read the Event at once.
                self.failed_creates.append(message)

    async def statefulset_controller(self) -> None:
        c = self.cluster
        all_pods = c.objects("v1/pods", None)
        pods = {(pod["metadata"]["namespace"], pod["metadata"]["name"]) for pod in all_pods}
        owned = _by_owner(all_pods)
        for sts in c.objects("apps/v1/statefulsets", None):
            meta, spec = sts["metadata"], sts["spec"]
            namespace = meta["namespace"]
            template = spec["template"]
            # What the real controller stamps on each pod (its ControllerRevision's name): the
            # reason a StatefulSet's name must leave 11 characters of a label value's 63.
            revision = f"{meta['name']}-{self._template_hash(sts)}"
            for ordinal in range(int(spec.get("replicas", 1))):
                name = f"{meta['name']}-{ordinal}"
                if (namespace, name) in pods:
                    continue
                pod = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": name,
                        "namespace": namespace,
                        "labels": {
                            **template["metadata"].get("labels", {}),
                            "apps.kubernetes.io/pod-index": str(ordinal),
                            "controller-revision-hash": revision,
                            "statefulset.kubernetes.io/pod-name": name,
                        },
                        "annotations": dict(template["metadata"].get("annotations", {})),
                        "ownerReferences": [_owner("StatefulSet", meta)],
                    },
                    "spec": {**template["spec"], "hostname": name, "subdomain": spec.get("serviceName")},
                }
                await self._create_pod("StatefulSet", sts, pod)
            for pod in owned.get(meta["uid"], []):
                name = pod["metadata"]["name"]
                ordinal = name.rsplit("-", 1)[-1]
                if (
                    ordinal.isdigit()
                    and int(ordinal) >= int(spec.get("replicas", 1))
                    and not pod["metadata"].get("deletionTimestamp")
                ):
                    await c.api("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}")

    async def deployment_controller(self) -> None:
        """Pods NAME-HASH-XXXXX from each Deployment's template (no ReplicaSet in between): as
        many as `replicas`; a changed template replaces them all (like strategy Recreate)."""
        c = self.cluster
        by_owner = _by_owner(c.objects("v1/pods", None))
        for deployment in c.objects("apps/v1/deployments", None):
            meta, spec = deployment["metadata"], deployment["spec"]
            template = spec["template"]
            current = self._template_hash(deployment)
            owned = [
                pod for pod in by_owner.get(meta["uid"], []) if not pod["metadata"].get("deletionTimestamp")
            ]
            outdated = [pod for pod in owned if pod["metadata"]["labels"].get("pod-template-hash") != current]
            fresh = [pod for pod in owned if pod not in outdated]
            surplus = fresh[int(spec.get("replicas", 1)) :]
            for pod in [*outdated, *surplus]:
                await c.api(
                    "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{pod['metadata']['name']}"
                )
            for _ in range(int(spec.get("replicas", 1)) - len(fresh)):
                pod = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "generateName": f"{meta['name']}-{current}-",
                        "namespace": meta["namespace"],
                        "labels": {**template["metadata"].get("labels", {}), "pod-template-hash": current},
                        "annotations": dict(template["metadata"].get("annotations", {})),
                        "ownerReferences": [_owner("Deployment", meta)],
                    },
                    "spec": dict(template["spec"]),
                }
                await self._create_pod("Deployment", deployment, pod)

    async def kubelet(self) -> None:
        c = self.cluster
        live = {pod["metadata"]["uid"]: pod for pod in c.objects("v1/pods", None)}
        for uid in [uid for uid in self._running_pods if uid not in live]:
            pod = self._running_pods.pop(uid)
            if self.on_pod_stop is not None:
                await self.on_pod_stop(pod)
        lost = self.scheduler.lost_nodes() if self.scheduler is not None else set()
        for uid, pod in live.items():
            meta = pod["metadata"]
            if pod["spec"].get("nodeName") in lost:
                # The node went away with its processes; its status stays what it last said.
                if uid in self._running_pods and self.on_pod_stop is not None:
                    await self.on_pod_stop(self._running_pods.pop(uid))
                continue
            if meta.get("deletionTimestamp") and pod["spec"].get("nodeName"):
                # A bound pod's deletion is graceful: the node's kubelet confirms it once stopped.
                with contextlib.suppress(AssertionError):
                    await c.api(
                        "DELETE",
                        f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                        {"gracePeriodSeconds": 0},
                        "application/json",
                    )
                continue
            if uid in self._running_pods or (pod.get("status") or {}).get("phase") not in (None, "Pending"):
                continue
            if self.scheduler is not None and not pod["spec"].get("nodeName"):
                continue  # not bound to a node yet
            if self.on_pod_start is not None:
                await self.on_pod_start(pod)
            self._running_pods[uid] = pod  # from here its stop hook runs once it is gone
            await self.set_pod_status(pod, self.running_status(pod))

    def running_status(self, pod: dict[str, Any]) -> dict[str, Any]:
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        ip = next(self._ips)
        return {
            "phase": "Running",
            "podIP": f"10.244.{ip // 250}.{ip % 250 + 1}",
            "hostIP": "172.18.0.2",
            "startTime": now,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
            "containerStatuses": [
                {
                    "name": container["name"],
                    "image": container.get("image"),
                    "ready": True,
                    "restartCount": 0,
                    "started": True,
                    "state": {"running": {"startedAt": now}},
                }
                for container in pod["spec"].get("containers", [])
            ],
        }

    async def set_pod_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        """Patches the status of exactly this pod (by uid: a pod deleted and created again under
        its name in the meantime is another pod, and one that is gone has no status to set)."""
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        current = self.cluster.get("v1/pods", meta["name"], meta["namespace"])
        if current is None or current["metadata"].get("uid") != meta.get("uid"):
            return
        try:
            await self.cluster.api("PATCH", path, {"status": status})
        except AssertionError:
            now = self.cluster.get("v1/pods", meta["name"], meta["namespace"])
            if now is not None and now["metadata"].get("uid") == meta.get("uid"):
                raise  # still there: a real refusal
            # Deleted (maybe created again, as another pod) between the check and the patch.

    async def fail_pod(self, name: str, message: str, exit_code: int = 1, namespace: str = "default") -> None:
        """The pod's container exits for good (what a crashed process on a node looks like)."""
        pod = self.cluster.get("v1/pods", name, namespace)
        assert pod is not None, f"no pod {name}"
        containers = pod["spec"]["containers"]
        status = {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": container["name"],
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": exit_code, "reason": "Error", "message": message}},
                }
                for container in containers
            ],
        }
        await self.set_pod_status(pod, status)

    async def garbage_collector(self) -> None:
        c = self.cluster
        # Repeat until nothing changes: deleting an owner orphans the next level down.
        while True:
            live = list(c.all_live())
            uids = {obj["metadata"].get("uid") for _, _, obj in live}
            orphans = [
                (res, ns, obj)
                for res, ns, obj in live
                if (refs := obj["metadata"].get("ownerReferences"))
                and not any(ref.get("uid") in uids for ref in refs)
                and not obj["metadata"].get("deletionTimestamp")  # going already (a pod stopping)
            ]
            if not orphans:
                return
            for res, ns, obj in orphans:
                with contextlib.suppress(AssertionError):  # already gone
                    await c.api("DELETE", resource_path(res, ns, obj["metadata"]["name"]))

    async def run_once(self) -> None:
        deletions = self.cluster.emulator.deletions
        if deletions != self._collected_after or self._passes % 20 == 0:
            # Before the pass: a deletion that lands during it is seen by the next one.
            self._collected_after = deletions
            await self.garbage_collector()
        self._passes += 1
        await self.statefulset_controller()
        await self.deployment_controller()
        if self.scheduler is not None:
            await self.scheduler.run_once()
        if self.fake_kubelet:
            await self.kubelet()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ClusterSim]:
        stopping = False

        async def loop() -> None:
            while True:
                try:
                    await self.run_once()
                    await asyncio.sleep(self.interval)
                except asyncio.CancelledError:
                    # An in-process kopf operator cancels, when it stops, every task born during
                    # its run: one inside a hook must not end the simulated controllers for good.
                    if stopping:
                        raise
                except Exception:
                    # Real controllers requeue after a failed pass (a race with a deletion, an API
                    # refusal): one failed pass must not stop every pod from ever starting again.
                    logger.exception("a pass of the simulated controllers failed; the next one retries")
                    self.failed_passes += 1
                    await asyncio.sleep(self.interval)

        task = asyncio.create_task(loop())
        try:
            yield self
        finally:
            stopping = True
            task.cancel()
            try:
                # A helper that crashed re-raises here and fails the test.
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            finally:
                for pod in list(self._running_pods.values()):
                    if self.on_pod_stop is not None:
                        await self.on_pod_stop(pod)
                self._running_pods.clear()
