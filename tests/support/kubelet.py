"""A kubelet for the test cluster: every pod in the API runs for real on this machine.

For each pod it finds (created by the operator or by the simulated StatefulSet / Deployment
controllers), it
- binds the pod to its node (`spec.nodeName`: from then on a delete is graceful); under a
  scheduler (tests/support/scheduler.py) it runs only the pods the scheduler bound, as the
  kubelets of all its nodes at once (every node is this machine), and plays a lost node: the
  pods of a NotReady node are killed at once and their deletions never confirmed,
- gives it a network namespace with a veth on the test bridge and a pod IP (pod_network.py),
- writes its Secret / ConfigMap volumes as files (modes and fsGroup as the real kubelet sets
  them), resolves its env (values, Secret / ConfigMap keys, fields),
- runs each container's real command (pod_sandbox.py): own mount and UTS namespaces, the
  image's files (image.py) and the pod's volumes laid over this machine's directories, its own
  /etc/hosts, /etc/resolv.conf and hostname, the container's user, groups and capabilities,
- reports phase, IP and container states (Running, Failed with the exit code and the log's tail,
  Succeeded) as they happen, restarts containers per restartPolicy with the real back-off,
- runs startup, readiness and liveness probes (httpGet, tcpSocket, exec) as specified; they
  drive `ready` and, on failure, kill the container,
- on deletion sends SIGTERM, waits `terminationGracePeriodSeconds`, then SIGKILLs every process
  of the pod, removes its namespace and veth and confirms the deletion,
- plays the cluster's DNS: every pod's /etc/hosts resolves the names of pods behind headless
  Services (`HOST.SUBDOMAIN.NS.svc`) and of Services (`NAME.NS.svc` -> a ready endpoint's IP),
  rewritten in place as pods come and go.

It runs on its own thread with its own event loop and talks to the API over HTTP only, so an
in-process operator stopping (kopf cancels the tasks born during its run) cannot touch it, and
it keeps running while a test's event loop waits. `stop()` removes every process, namespace,
veth and the bridge, also when the test failed; what a crashed run left behind is swept by the
next one (pod_network.sweep_stale). What it does not do is listed in tests/support/README.md.

Its parts: pod_state.py (what it knows of pods and containers), pod_network.py, pod_sandbox.py
(a container's first process), pod_dns.py, pod_probes.py, image.py (the image's files).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from tests.support import pod_network
from tests.support.image import Image
from tests.support.pod_dns import CLUSTER_DOMAIN, Table, dns_table, hosts_file, lookup
from tests.support.pod_probes import Prober
from tests.support.pod_state import (
    EXECUTIONS,
    ContainerState,
    Execution,
    PodRuntime,
    PodSetupError,
    expand,
    kill_all,
    kill_container,
    mount_namespace_of,
    now,
    processes_in,
    release,
)

if TYPE_CHECKING:
    from tests.support.scheduler import Scheduler

SANDBOX = Path(__file__).with_name("pod_sandbox.py")
# Machine-wide: every running kubelet holds MACHINE_LOCK shared; MOUNT_POINTS_MADE lists the
# top-level directories kubelets created for mount points, removed by the last one to stop.
MACHINE_LOCK = Path("/run/berth-test-kubelet.lock")
MOUNT_POINTS_MADE = Path("/run/berth-test-kubelet-mount-points")
NODE_NAME = "berth-test-node"
# The real kubelet's numbers.
DEFAULT_GRACE_SECONDS = 30
BACKOFF_SECONDS, MAX_BACKOFF_SECONDS = 10.0, 300.0
DEFAULT_SHM_BYTES = 64 * 2**20  # a container runtime's /dev/shm
SUPPORTED_VOLUMES = ("secret", "configMap", "emptyDir", "hostPath")
# What an API call may end in while the test's event loop (which serves the emulator) is busy
# or gone: the next round tries again.
API_ERRORS = (aiohttp.ClientError, TimeoutError)
logger = logging.getLogger(__name__)


class Kubelet:
    """Start with `async with Kubelet(...).running():`; everything it made is gone afterwards."""

    def __init__(
        self,
        server: str,
        root: Path,
        image: Image,
        poll_interval: float = 0.1,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.server = server
        # tests/support/scheduler.py's Scheduler: pods wait for its binding, nodes may be lost.
        # (Only its presence matters: nodes are read over HTTP like everything else.)
        self.scheduler = scheduler
        self.lost: set[str] = set()  # uids of the pods of lost nodes: never run or confirmed again
        self.root = root
        self.image = image
        self.poll_interval = poll_interval
        self.network: pod_network.PodNetwork | None = None
        self.pods: dict[str, PodRuntime] = {}  # uid -> runtime
        self.problems: list[str] = []  # pods this kubelet refused (features it lacks)
        self.executions: list[Execution] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._hosts_table: Table = {}
        self._services: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._prober: Prober | None = None
        self._machine_share: int | None = None  # a shared lock on MACHINE_LOCK while running

    # --- life cycle ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Kubelet]:
        await asyncio.to_thread(self.start)
        try:
            yield self
        finally:
            # On a thread: the kubelet may still be talking to the emulator on this loop.
            await asyncio.to_thread(self.stop)

    def start(self) -> None:
        self._machine_share = os.open(MACHINE_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._machine_share, fcntl.LOCK_SH)
        self.network = pod_network.PodNetwork.create()
        self.root.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._thread_main, name="test-kubelet", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("the test kubelet did not start")

    def stop(self) -> None:
        self._stopping = True
        if self._thread is not None:
            self._thread.join(60)
        # Whatever the loop did not get to (or if it died): no process and no device survives.
        for runtime in list(self.pods.values()):
            for container in runtime.containers:
                kill_all(container.mount_namespace)
                release(container)
        if self.network is not None:
            self.network.close()
        self._remove_mount_points_if_last()
        shutil.rmtree(self.root, ignore_errors=True)
        if self._error is not None:
            raise RuntimeError("the test kubelet crashed") from self._error

    def _remove_mount_points_if_last(self) -> None:
        """Remove the top-level mount points kubelets made, once no kubelet on the machine runs.

        Another suite's kubelet may run beside this one (two checkouts), and its pods may mount
        a directory this one created: the last kubelet to stop removes them, not the first.
        """
        if self._machine_share is None:
            return
        share, self._machine_share = self._machine_share, None
        try:
            fcntl.flock(share, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only if no other kubelet holds it
        except BlockingIOError:
            os.close(share)
            return
        try:
            made = MOUNT_POINTS_MADE.read_text().split() if MOUNT_POINTS_MADE.exists() else []
            for directory in made:
                with contextlib.suppress(OSError):
                    os.rmdir(directory)  # only if still empty: never anyone else's files
            MOUNT_POINTS_MADE.unlink(missing_ok=True)
        finally:
            os.close(share)

    def _thread_main(self) -> None:
        try:
            # asyncio.run cancels and awaits whatever is still pending when _main returns.
            asyncio.run(self._main())
        except BaseException as error:  # reported by stop()
            self._error = error
        finally:
            self._started.set()

    async def _main(self) -> None:
        # A fresh connection per request: an in-process operator that stops cancels the
        # emulator's handlers born during its run, and a kept-alive connection whose handler was
        # cancelled would hang the next request until its timeout.
        connector = aiohttp.TCPConnector(force_close=True)
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as self._session:
            self._prober = Prober(self._session, self.problems)
            self._started.set()
            while not self._stopping:
                # A failed round (the emulator going away with its test): the next one decides.
                with contextlib.suppress(*API_ERRORS):
                    await self._sync()
                await asyncio.sleep(self.poll_interval)
            await self._shutdown()

    async def _shutdown(self) -> None:
        for runtime in list(self.pods.values()):
            runtime.deletion.set()
            runtime.removed.set()  # no API writes while shutting down
        tasks = [runtime.task for runtime in self.pods.values() if runtime.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=30)

    # --- the API ---------------------------------------------------------------------------

    async def _api(self, method: str, path: str, body: Any = None, content_type: str | None = None) -> Any:
        headers = {"Content-Type": content_type or "application/merge-patch+json"} if body is not None else {}
        async with self._session.request(method, self.server + path, json=body, headers=headers) as response:
            payload = await response.json(content_type=None)
            if response.status == 404:
                return None
            if response.status >= 400:
                raise aiohttp.ClientResponseError(
                    response.request_info, (), status=response.status, message=str(payload)
                )
            return payload

    async def _get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._api("GET", f"/api/v1/namespaces/{namespace}/{kind}/{name}")

    def _pod_path(self, runtime: PodRuntime, sub: str = "") -> str:
        return f"/api/v1/namespaces/{runtime.namespace}/pods/{runtime.name}{sub}"

    # --- one round -------------------------------------------------------------------------

    async def _lost_nodes(self) -> set[str]:
        """Nodes whose Ready condition is not True (none without a scheduler: its one node)."""
        if self.scheduler is None:
            return set()
        nodes = (await self._api("GET", "/api/v1/nodes") or {}).get("items", [])
        return {
            node["metadata"]["name"]
            for node in nodes
            if not any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in (node.get("status") or {}).get("conditions") or []
            )
        }

    def _lose(self, runtime: PodRuntime) -> None:
        """The pod's node is gone: its processes die with it, nothing reports or confirms again
        (the API keeps the pod as it last was; a deletion stays Terminating)."""
        self.lost.add(runtime.uid)
        runtime.lost = True
        runtime.removed.set()
        runtime.deletion.set()

    async def _sync(self) -> None:
        pods = (await self._api("GET", "/api/v1/pods") or {}).get("items", [])
        self._services = (await self._api("GET", "/api/v1/services") or {}).get("items", [])
        lost_nodes = await self._lost_nodes()
        seen = set()
        for pod in pods:
            meta = pod["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            runtime = self.pods.get(uid)
            if uid in self.lost:
                continue
            if self.scheduler is not None:
                node = pod["spec"].get("nodeName")
                if not node:
                    continue  # not bound yet: no node's kubelet knows it
                if node in lost_nodes:
                    if runtime is not None:
                        self._lose(runtime)
                    self.lost.add(uid)
                    continue
            if runtime is None:
                if meta.get("deletionTimestamp"):
                    # Deleted before it ever ran here: confirm at once.
                    await self._api(
                        "DELETE",
                        f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                        {"gracePeriodSeconds": 0},
                        "application/json",
                    )
                    continue
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                runtime = PodRuntime(
                    uid=uid,
                    namespace=meta["namespace"],
                    name=meta["name"],
                    pod=pod,
                    root=self.root / f"{meta['namespace']}_{meta['name']}_{uid[:8]}",
                    containers=[ContainerState(spec) for spec in pod["spec"].get("containers", [])],
                    init_containers=[
                        ContainerState(spec) for spec in pod["spec"].get("initContainers") or []
                    ],
                )
                self.pods[uid] = runtime
                runtime.task = asyncio.create_task(self._run_pod(runtime))
            else:
                runtime.pod = pod
                if meta.get("deletionTimestamp"):
                    runtime.deletion.set()
        for uid, runtime in list(self.pods.items()):
            if uid not in seen:
                # Removed without a graceful deletion (an unbound pod, a forced delete).
                runtime.removed.set()
                runtime.deletion.set()
        self._update_dns()

    # --- a pod -----------------------------------------------------------------------------

    async def _run_pod(self, runtime: PodRuntime) -> None:
        status_task = asyncio.create_task(self._report_status(runtime))
        try:
            await self._start_pod(runtime)
            if not await self._run_init_containers(runtime):
                await runtime.deletion.wait()
                return
            runners = [asyncio.create_task(self._run_container(runtime, c)) for c in runtime.containers]
            await asyncio.wait(
                [*runners, asyncio.create_task(runtime.deletion.wait())], return_when=asyncio.FIRST_COMPLETED
            )
            if runtime.deletion.is_set():
                await self._terminate(runtime)
            await asyncio.gather(*runners, return_exceptions=True)
            await runtime.deletion.wait()  # a finished pod keeps its IP until it is deleted
        except PodSetupError as error:
            runtime.waiting = (error.reason, str(error))
            if error.permanent:
                self.problems.append(f"pod {runtime.namespace}/{runtime.name}: {error}")
            await runtime.deletion.wait()
        except Exception as error:  # a bug here, or the machine refusing: the test must hear of it
            runtime.waiting = ("KubeletError", f"{type(error).__name__}: {error}")
            self.problems.append(f"pod {runtime.namespace}/{runtime.name}: the kubelet failed: {error!r}")
            await runtime.deletion.wait()
        finally:
            for container in [*runtime.init_containers, *runtime.containers]:
                await self._end_container(container)
            if runtime.interface is not None and self.network is not None:
                await asyncio.to_thread(self.network.remove_pod, runtime.interface.netns)
            shutil.rmtree(runtime.root, ignore_errors=True)
            await self._flush_status(runtime, status_task)
            if not runtime.removed.is_set():
                with contextlib.suppress(*API_ERRORS):
                    await self._api(
                        "DELETE", self._pod_path(runtime), {"gracePeriodSeconds": 0}, "application/json"
                    )
            self.pods.pop(runtime.uid, None)
            self._update_dns()

    async def _flush_status(self, runtime: PodRuntime, status_task: asyncio.Task[None]) -> None:
        status_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, *API_ERRORS):
            await status_task

    async def _start_pod(self, runtime: PodRuntime) -> None:
        spec = runtime.spec
        unsupported = ["ephemeralContainers"] if spec.get("ephemeralContainers") else []
        if spec.get("hostNetwork") or spec.get("hostPID"):
            unsupported.append("hostNetwork/hostPID")
        if unsupported:
            raise PodSetupError(
                "Unsupported", f"the test kubelet cannot run {', '.join(unsupported)}", permanent=True
            )
        if self.scheduler is None:
            # Bound to this node: from now on the API server deletes the pod gracefully.
            await self._api("PATCH", self._pod_path(runtime), {"spec": {"nodeName": NODE_NAME}})
        runtime.root.mkdir(parents=True)
        assert self.network is not None
        runtime.interface = await asyncio.to_thread(self.network.add_pod)
        while True:
            try:
                await self._prepare_volumes(runtime)
                break
            except PodSetupError as error:
                if error.permanent:
                    raise
                runtime.waiting = (error.reason, str(error))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(runtime.deletion.wait(), 1.0)
                if runtime.deletion.is_set():
                    raise
        runtime.waiting = None
        self._write_pod_files(runtime)

    # --- volumes and files ---------------------------------------------------------------

    def _fs_group(self, runtime: PodRuntime) -> int | None:
        return (runtime.spec.get("securityContext") or {}).get("fsGroup")

    def _write_files(
        self, runtime: PodRuntime, directory: Path, data: Mapping[str, bytes], volume: Mapping[str, Any]
    ) -> None:
        """A Secret / ConfigMap volume: one file per key (or per item), with the volume's modes;
        with an fsGroup, group-owned and group-readable, as the kubelet's volume ownership does."""
        directory.mkdir(parents=True)
        items = volume.get("items")
        chosen = (
            [(item["key"], item["path"], item.get("mode")) for item in items]
            if items
            else [(key, key, None) for key in data]
        )
        fs_group = self._fs_group(runtime)
        for key, relative, mode in chosen:
            if key not in data:
                raise PodSetupError("FailedMount", f"key {key!r} is not in the volume's source")
            path = directory / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data[key])
            file_mode = mode if mode is not None else volume.get("defaultMode", 0o644)
            if fs_group is not None:
                os.chown(path, 0, fs_group)
                file_mode |= 0o440
            os.chmod(path, file_mode)
        if fs_group is not None:
            os.chown(directory, 0, fs_group)
        os.chmod(directory, 0o2755 if fs_group is not None else 0o755)

    async def _prepare_volumes(self, runtime: PodRuntime) -> None:
        volumes_dir = runtime.root / "volumes"
        shutil.rmtree(volumes_dir, ignore_errors=True)
        volumes_dir.mkdir()
        for volume in runtime.spec.get("volumes") or []:
            kinds = [kind for kind in volume if kind != "name"]
            kind = kinds[0] if kinds else "emptyDir"
            if kind not in SUPPORTED_VOLUMES:
                raise PodSetupError(
                    "Unsupported", f"volume {volume['name']}: the test kubelet has no {kind}", permanent=True
                )
            target = volumes_dir / volume["name"]
            source = volume[kind] or {}
            if kind in ("secret", "configMap"):
                secret = kind == "secret"
                name = source["secretName"] if secret else source["name"]
                obj = await self._get("secrets" if secret else "configmaps", runtime.namespace, name)
                if obj is None:
                    if source.get("optional"):
                        target.mkdir()
                        continue
                    raise PodSetupError("FailedMount", f'{kind.lower()} "{name}" not found')
                decode = base64.b64decode if secret else str.encode
                data = {key: decode(value) for key, value in (obj.get("data") or {}).items()}
                self._write_files(runtime, target, data, source)
            elif kind == "emptyDir":
                target.mkdir()
                os.chmod(target, 0o777)
            elif kind == "hostPath":
                path = Path(source["path"])
                if source.get("type") == "Directory" and not path.is_dir():
                    raise PodSetupError("FailedMount", f"hostPath {path} is not a directory")

    def _volume_source(self, runtime: PodRuntime, name: str) -> tuple[str, dict[str, Any]]:
        for volume in runtime.spec.get("volumes") or []:
            if volume["name"] == name:
                if "hostPath" in volume:
                    return volume["hostPath"]["path"], volume
                return str(runtime.root / "volumes" / name), volume
        raise PodSetupError("Unsupported", f"volumeMount of an undeclared volume {name!r}", permanent=True)

    def _write_pod_files(self, runtime: PodRuntime) -> None:
        etc = runtime.root / "etc"
        etc.mkdir()
        (etc / "hostname").write_text(runtime.hostname + "\n")
        search = f"{runtime.namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
        # No DNS server listens in the pod: a name missing from /etc/hosts fails at once.
        (etc / "resolv.conf").write_text(
            f"nameserver 127.0.0.1\nsearch {search}\noptions ndots:5 timeout:1 attempts:1\n"
        )
        runtime.hosts_file = etc / "hosts"
        runtime.hosts_file.write_text(hosts_file(runtime, self._hosts_table))

    # --- cluster DNS ------------------------------------------------------------------------

    def _update_dns(self) -> None:
        table = dns_table(self.pods.values(), self._services)
        if table == self._hosts_table:
            return
        self._hosts_table = table
        for runtime in self.pods.values():
            if runtime.hosts_file is not None and runtime.hosts_file.exists():
                # In place (same inode): the file is bind-mounted into the pod's containers.
                runtime.hosts_file.write_text(hosts_file(runtime, table))

    def resolve(self, namespace: str, name: str) -> str | None:
        """What a pod's /etc/hosts says the fully qualified `name` is (for tests)."""
        return lookup(self._hosts_table, namespace, name)

    # --- status ----------------------------------------------------------------------------

    def _pod_status(self, runtime: PodRuntime) -> dict[str, Any]:
        containers = runtime.containers
        if runtime.phase in ("Pending", "Running"):
            if any(c.state.get("running") for c in containers) or any(c.restart_count for c in containers):
                runtime.phase = "Running"
            if containers and all(c.done for c in containers):
                failed = any((c.state.get("terminated") or {}).get("exitCode") for c in containers)
                runtime.phase = "Failed" if failed else "Succeeded"
        ready = runtime.ready
        stamp = now()
        conditions = [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": str(runtime.initialized or not runtime.init_containers)},
            {"type": "ContainersReady", "status": str(ready)},
            {"type": "Ready", "status": str(ready)},
        ]
        status: dict[str, Any] = {
            "phase": runtime.phase,
            "hostIP": self.network.gateway if self.network else None,
            "podIP": runtime.ip,
            "podIPs": [{"ip": runtime.ip}] if runtime.ip else [],
            "startTime": runtime.started_at,
            "conditions": conditions,
            "containerStatuses": [c.status() for c in containers],
            "initContainerStatuses": [c.status() for c in runtime.init_containers],
            "reason": None,
            "message": None,
        }
        if runtime.waiting:
            reason, message = runtime.waiting
            for container in status["containerStatuses"]:
                container["state"] = {"waiting": {"reason": reason, "message": message}}
        for condition in conditions:
            condition["lastTransitionTime"] = stamp
        return status

    async def _report_status(self, runtime: PodRuntime) -> None:
        last: str | None = None
        while True:
            try:
                last = await self._report_once(runtime, last)
            except Exception:
                # One failed report must not freeze the pod's status for good (its phase would
                # say Running after its container died): the next round reports again.
                logger.exception("reporting the status of pod %s/%s failed", runtime.namespace, runtime.name)
            await asyncio.sleep(self.poll_interval)

    async def _report_once(self, runtime: PodRuntime, last: str | None) -> str | None:
        """Patches the pod's status if it changed; returns what was last reported."""
        status = self._pod_status(runtime)
        # Transition times are stamped when something else changed, not every round.
        comparable = json.dumps(
            {
                **status,
                "conditions": [
                    {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status["conditions"]
                ],
            },
            sort_keys=True,
        )
        if comparable != last and not runtime.removed.is_set():
            try:
                await self._api("PATCH", self._pod_path(runtime, "/status"), {"status": status})
                return comparable
            except API_ERRORS:
                pass
        return last

    # --- containers --------------------------------------------------------------------------

    def _security(self, runtime: PodRuntime, container: ContainerState) -> list[str]:
        """setpriv arguments for the container's securityContext (pod-level defaults first)."""
        pod_context = runtime.spec.get("securityContext") or {}
        context = {**pod_context, **(container.spec.get("securityContext") or {})}
        args: list[str] = []
        uid, gid = context.get("runAsUser"), context.get("runAsGroup")
        if context.get("runAsNonRoot") and not uid:
            raise PodSetupError(
                "CreateContainerConfigError",
                "container has runAsNonRoot and the image will run as root (set runAsUser)",
            )
        if uid is not None or gid is not None:
            groups = [
                g
                for g in [gid, pod_context.get("fsGroup"), *(pod_context.get("supplementalGroups") or [])]
                if g is not None
            ]
            args += [f"--reuid={uid or 0}", f"--regid={gid if gid is not None else 0}"]
            args += [f"--groups={','.join(str(g) for g in groups)}"] if groups else ["--clear-groups"]
        if context.get("allowPrivilegeEscalation") is False:
            args.append("--no-new-privs")
        capabilities = context.get("capabilities") or {}
        if capabilities.get("drop") or capabilities.get("add"):
            drop = [c.lower() for c in capabilities.get("drop") or []]
            parts = ["-all"] if "all" in drop else [f"-{c}" for c in drop]
            parts += [f"+{c.lower()}" for c in capabilities.get("add") or []]
            # setpriv names capabilities without the cap_ prefix (NET_BIND_SERVICE: net_bind_service).
            args.append("--bounding-set=" + ",".join(parts))
        return args

    async def _resolve_env(self, runtime: PodRuntime, container: ContainerState) -> dict[str, str]:
        env: dict[str, str] = dict(self.image.env)
        for source in container.spec.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "secretRef" in source:
                secret = await self._get("secrets", runtime.namespace, source["secretRef"]["name"]) or {}
                env.update(
                    {prefix + k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
                )
            elif "configMapRef" in source:
                config_map = (
                    await self._get("configmaps", runtime.namespace, source["configMapRef"]["name"]) or {}
                )
                env.update({prefix + k: v for k, v in (config_map.get("data") or {}).items()})
        for var in container.spec.get("env") or []:
            name = var["name"]
            if "valueFrom" not in var:
                env[name] = expand(str(var.get("value", "")), env)
                continue
            ref = var["valueFrom"]
            source = next((kind for kind in ("secretKeyRef", "configMapKeyRef") if kind in ref), None)
            if source is not None:
                value = await self._key(runtime, source, ref[source])
                if value is not None:
                    env[name] = value
            elif "fieldRef" in ref:
                env[name] = self._field(runtime, ref["fieldRef"]["fieldPath"])
            else:
                raise PodSetupError(
                    "Unsupported", f"env {name}: the test kubelet cannot resolve {list(ref)}", permanent=True
                )
        return env

    async def _key(self, runtime: PodRuntime, source: str, key_ref: Mapping[str, Any]) -> str | None:
        """One key of a Secret or ConfigMap (None when missing and optional)."""
        kind, plural = ("secret", "secrets") if source == "secretKeyRef" else ("configmap", "configmaps")
        obj = await self._get(plural, runtime.namespace, key_ref["name"])
        value = ((obj or {}).get("data") or {}).get(key_ref["key"])
        if value is None:
            if key_ref.get("optional"):
                return None
            raise PodSetupError(
                "CreateContainerConfigError",
                f'{kind} "{key_ref["name"]}" or its key "{key_ref["key"]}" not found',
            )
        return base64.b64decode(value).decode() if kind == "secret" else value

    def _field(self, runtime: PodRuntime, path: str) -> str:
        meta = runtime.pod["metadata"]
        simple = {
            "metadata.name": runtime.name,
            "metadata.namespace": runtime.namespace,
            "metadata.uid": runtime.uid,
            "spec.nodeName": runtime.node or NODE_NAME,
            "spec.serviceAccountName": runtime.spec.get("serviceAccountName", "default"),
            "status.podIP": runtime.ip or "",
            "status.hostIP": self.network.gateway if self.network else "",
        }
        if path in simple:
            return simple[path]
        match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if match:
            return (meta.get(match[1]) or {}).get(match[2], "")
        raise PodSetupError("Unsupported", f"fieldRef {path} is not supported", permanent=True)

    def _sandbox_plan(
        self,
        runtime: PodRuntime,
        container: ContainerState,
        env: dict[str, str],
        security: list[str],
        instance: Path,
    ) -> dict[str, Any]:
        spec = container.spec
        argv = [*(spec.get("command") or []), *(spec.get("args") or [])]
        if not spec.get("command"):
            raise PodSetupError(
                "Unsupported", "the test image has no ENTRYPOINT: set the container's command", permanent=True
            )
        argv = [expand(arg, env) for arg in argv]
        overlays, layered = [], self.image.layers()
        for target, lower in layered.items():
            upper, work = instance / "upper" / target.strip("/"), instance / "work" / target.strip("/")
            upper.mkdir(parents=True)
            work.mkdir(parents=True)
            overlays.append({"target": target, "lower": [str(lower)], "upper": str(upper), "work": str(work)})
        mounts: list[dict[str, Any]] = []
        for mount in sorted(spec.get("volumeMounts") or [], key=lambda m: m["mountPath"].count("/")):
            source, volume = self._volume_source(runtime, mount["name"])
            target = mount["mountPath"]
            if not os.path.exists(target) and not any(target.startswith(t + "/") for t in layered):
                self._mount_point_layer(target, instance, overlays)
            if "emptyDir" in volume and (volume["emptyDir"] or {}).get("medium") == "Memory":
                options = "mode=1777"
                if (volume["emptyDir"] or {}).get("sizeLimit"):
                    options += f",size={_tmpfs_size(volume['emptyDir']['sizeLimit'])}"
                mounts.append({"type": "tmpfs", "target": target, "options": options})
                continue
            if mount.get("subPath"):
                source = str(Path(source) / mount["subPath"])
            readonly = bool(mount.get("readOnly")) or "secret" in volume or "configMap" in volume
            mounts.append({"type": "bind", "source": source, "target": target, "readonly": readonly})
        assert runtime.hosts_file is not None
        for name in ("hosts", "hostname", "resolv.conf"):
            mounts.append(
                {
                    "type": "bind",
                    "source": str(runtime.root / "etc" / name),
                    "target": f"/etc/{name}",
                    "readonly": False,
                }
            )
        # A container's /tmp and /dev/shm are its own (empty in the image), never the machine's
        # or another pod's: an engine's IPC sockets live there. /tmp comes last, once every
        # source below this machine's /tmp (the pod's volumes) is mounted.
        if not any(mount["target"] == "/dev/shm" for mount in mounts):
            mounts.append(
                {"type": "tmpfs", "target": "/dev/shm", "options": f"mode=1777,size={DEFAULT_SHM_BYTES}"}
            )
        mounts.append({"type": "tmpfs", "target": "/tmp", "options": "mode=1777"})
        for path in self.image.under_machine_tmp:  # the checkout and venv, if they lie under /tmp
            mounts.append({"type": "bind", "source": path, "target": path, "readonly": True})
        uid = next((int(a.split("=")[1]) for a in security if a.startswith("--reuid=")), 0)
        env.setdefault("HOME", self.image.home_of(uid))
        env.setdefault("HOSTNAME", runtime.hostname)
        return {
            "netns": str(pod_network.NETNS_DIR / runtime.interface.netns),  # type: ignore[union-attr]
            "hostname": runtime.hostname,
            "overlays": overlays,
            "mounts": mounts,
            "env": env,
            "argv": argv,
            "cwd": spec.get("workingDir") or "/",
            "setpriv": security,
        }

    def _mount_point_layer(self, target: str, instance: Path, overlays: list[dict[str, Any]]) -> None:
        """Make room for a mount point the machine lacks, without leaving it on the machine.

        Under an existing machine directory (/mnt/models): that directory gets a per-container
        copy-on-write layer, and the mount point is created inside it. A missing top-level
        directory (/models) cannot be layered (that would be the root itself): it is created
        empty on the machine, once, and removed when the kubelet stops.
        """
        top = "/" + target.strip("/").split("/")[0]
        with self._lock:
            if not os.path.exists(top):
                with contextlib.suppress(FileExistsError):  # another suite's kubelet, just now
                    os.mkdir(top, 0o755)
                with MOUNT_POINTS_MADE.open("a") as made:
                    made.write(top + "\n")
        if target == top or any(layer["target"] == top for layer in overlays):
            return
        upper, work = instance / "upper" / top.strip("/"), instance / "work" / top.strip("/")
        upper.mkdir(parents=True)
        work.mkdir(parents=True)
        overlays.append({"target": top, "lower": [], "upper": str(upper), "work": str(work)})

    async def _start_container(self, runtime: PodRuntime, container: ContainerState) -> None:
        env = await self._resolve_env(runtime, container)
        security = self._security(runtime, container)
        instance = runtime.root / "containers" / f"{container.name}-{container.restart_count}"
        instance.mkdir(parents=True)
        plan = self._sandbox_plan(runtime, container, env, security, instance)
        (instance / "plan.json").write_text(json.dumps(plan))
        log = runtime.root / "logs" / f"{container.name}-{container.restart_count}.log"
        log.parent.mkdir(exist_ok=True)
        # Logs outlive the pod's directory until the session ends (the coverage report reads them).
        kept_log = (
            self.root.parent
            / "kubelet-logs"
            / f"{runtime.namespace}_{runtime.name}_{runtime.uid[:8]}"
            / log.name
        )
        kept_log.parent.mkdir(parents=True, exist_ok=True)
        execution = Execution(
            namespace=runtime.namespace,
            pod=runtime.name,
            role=runtime.labels.get("berth.dev/role"),
            container=container.name,
            argv=plan["argv"],
            log=kept_log,
        )
        with kept_log.open("ab") as output:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                str(SANDBOX),
                str(instance / "plan.json"),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=output,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        execution.pid = process.pid
        container.process, container.execution = process, execution
        self.executions.append(execution)
        EXECUTIONS.append(execution)
        own = mount_namespace_of(os.getpid())
        deadline = time.monotonic() + 10
        while process.returncode is None and time.monotonic() < deadline:
            try:
                fd = os.open(f"/proc/{process.pid}/ns/mnt", os.O_RDONLY)
            except OSError:
                break  # already gone
            namespace = f"mnt:[{os.fstat(fd).st_ino}]"
            if namespace != own:
                container.mount_namespace, container.namespace_fd = namespace, fd
                break
            os.close(fd)
            await asyncio.sleep(0.005)
        container.state = {"running": {"startedAt": now()}}
        container.kill_reason = None

    async def _run_container(self, runtime: PodRuntime, container: ContainerState) -> None:
        policy = runtime.spec.get("restartPolicy", "Always")
        while not runtime.deletion.is_set():
            try:
                await self._start_container(runtime, container)
            except PodSetupError as error:
                container.state = {"waiting": {"reason": error.reason, "message": str(error)}}
                if error.permanent:
                    self.problems.append(f"pod {runtime.namespace}/{runtime.name}: {error}")
                    container.done = True
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(runtime.deletion.wait(), 1.0)
                continue
            assert container.process is not None
            assert self._prober is not None
            probes = asyncio.create_task(self._prober.run(runtime, container))
            code = await container.process.wait()
            if probes.done() and not probes.cancelled() and probes.exception() is not None:
                # Its probes stopped while it ran: the kubelet's bug, not the pod's.
                error = probes.exception()
                self.problems.append(f"pod {runtime.namespace}/{runtime.name}: probes failed: {error!r}")
            probes.cancel()
            _, running = await asyncio.wait([probes], timeout=10)
            if running:
                self.problems.append(f"pod {runtime.namespace}/{runtime.name}: its probes outlived it")
            # The container ends with its main process: whatever it left running goes too (on a
            # node, the container's PID namespace ending kills them).
            await self._end_container(container)
            exit_code = code if code >= 0 else 128 - code
            container.ready = False
            assert container.execution is not None
            container.execution.exit_code = exit_code
            container.execution.killed_by = container.kill_reason
            terminated: dict[str, Any] = {
                "exitCode": exit_code,
                "reason": "Completed" if exit_code == 0 else "Error",
                "startedAt": container.state.get("running", {}).get("startedAt"),
                "finishedAt": now(),
            }
            if exit_code and container.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
                terminated["message"] = container.execution.log_tail()
            if code < 0:
                terminated["signal"] = -code
            container.state = {"terminated": terminated}
            restart = policy == "Always" or (policy == "OnFailure" and exit_code != 0)
            if runtime.deletion.is_set() or not restart:
                container.done = True
                return
            # The real kubelet's back-off: the first restart at once, then 10 s, 20 s, 40 s ... 5 min.
            delay = (
                min(BACKOFF_SECONDS * 2 ** (container.restart_count - 1), MAX_BACKOFF_SECONDS)
                if (container.restart_count)
                else 0.0
            )
            container.last_state = {"terminated": terminated}
            container.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay:.0f}s restarting failed container",
                }
            }
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(runtime.deletion.wait(), delay)
            container.restart_count += 1

    async def _run_init_containers(self, runtime: PodRuntime) -> bool:
        """Each init container to completion, in order, before the pod's containers start (a
        failed one is run again with the real back-off, or fails the pod under restartPolicy
        Never). False when the pod will not start."""
        retry_failed = runtime.spec.get("restartPolicy", "Always") != "Never"
        for container in runtime.init_containers:
            while not runtime.deletion.is_set():
                await self._start_container(runtime, container)
                assert container.process is not None and container.execution is not None
                code = await container.process.wait()
                await self._end_container(container)
                exit_code = code if code >= 0 else 128 - code
                container.execution.exit_code = exit_code
                container.state = {
                    "terminated": {
                        "exitCode": exit_code,
                        "reason": "Completed" if exit_code == 0 else "Error",
                    }
                }
                if exit_code == 0:
                    break
                if not retry_failed:
                    runtime.phase = "Failed"
                    return False
                delay = min(BACKOFF_SECONDS * 2**container.restart_count, MAX_BACKOFF_SECONDS)
                container.restart_count += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(runtime.deletion.wait(), delay)
        runtime.initialized = not runtime.deletion.is_set()
        return runtime.initialized

    async def _end_container(self, container: ContainerState) -> None:
        """Kill what is left of a container, wait until it is gone, then let its namespace go."""
        deadline = time.monotonic() + 10
        while container.mount_namespace and processes_in(container.mount_namespace):
            kill_all(container.mount_namespace)
            if time.monotonic() > deadline:
                self.problems.append(f"container {container.name}: processes survived SIGKILL")
                break
            await asyncio.sleep(0.01)
        release(container)

    async def _terminate(self, runtime: PodRuntime) -> None:
        """SIGTERM to every container's main process, the grace period, then SIGKILL."""
        meta = runtime.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = runtime.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
        if self._stopping:
            # The kubelet itself stops (a test is over): every process is killed, no grace period
            # is waited for (a graceful exit is what deleting a pod in a test shows).
            grace = 0
        running = [c for c in runtime.containers if c.process is not None and c.process.returncode is None]
        if runtime.lost:
            # The node went down (power, kernel, network): no process gets a word in.
            for container in running:
                kill_container(container)
            await asyncio.gather(*(c.process.wait() for c in running))  # type: ignore[union-attr]
            return
        for container in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(container.process.pid, signal.SIGTERM)  # type: ignore[union-attr]
        if running:
            _, pending = await asyncio.wait(
                [asyncio.create_task(c.process.wait()) for c in running],
                timeout=float(grace),  # type: ignore[union-attr]
            )
            for container in running:
                if container.process is not None and container.process.returncode is None:
                    kill_container(container)
            if pending:
                await asyncio.wait(pending, timeout=10)

    # --- for tests ----------------------------------------------------------------------------

    def runtime(self, name: str, namespace: str = "default") -> PodRuntime:
        matches = [r for r in self.pods.values() if r.name == name and r.namespace == namespace]
        assert matches, f"the kubelet runs no pod {namespace}/{name}"
        return matches[-1]

    def processes(self, name: str, container: str | None = None, namespace: str = "default") -> list[int]:
        """PIDs of every process of a pod's container (all containers by default)."""
        runtime = self.runtime(name, namespace)
        return [
            pid
            for state in runtime.containers
            if (container is None or state.name == container) and state.mount_namespace
            for pid in processes_in(state.mount_namespace)
        ]

    def netns_names(self) -> list[str]:
        return list(self.network.pods) if self.network else []


def _tmpfs_size(quantity: str) -> str:
    """A Kubernetes quantity as a tmpfs size= option (bytes)."""
    match = re.fullmatch(r"(\d+)([KMGT]i?)?", str(quantity))
    if not match:
        return str(quantity)
    number, suffix = int(match[1]), match[2] or ""
    scale = {
        "": 1,
        "K": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }[suffix]
    return str(number * scale)
