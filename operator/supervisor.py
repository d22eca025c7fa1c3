"""The health loop of one LLMDeployment: poll every world, restart dead ones, write status.

One `Supervisor` lives in the kopf daemon of each LLMDeployment (handlers.py). Each `tick()`
reads the pods, polls each running launcher, lets `worlds.step()` judge, carries out its
orders (restart a world, create a missing launcher), posts Events and patches status.
It is the only writer of `status.worlds`, `status.conditions` and the phase; a resumed
operator starts from what status says, so restart counts and backoff survive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from berth.operator import conditions, naming, reconcile, render, worlds
from berth.operator.crd_model import API_VERSION, KIND, InvalidSpec, LLMDeploymentSpec, parse_spec
from berth.operator.health import AddressResolver, Probe, probe, resolve
from berth.operator.kube import Conflict, Kube
from berth.operator.metrics import OperatorMetrics

SETTLED_PHASES = ("Ready", "Failed")
FAST_INTERVAL = 2.0
EventSink = Callable[[str, str, str], None]  # (type, reason, message)


class Supervisor:
    def __init__(
        self,
        kube: Kube,
        http: httpx.AsyncClient,
        resolver: AddressResolver,
        metrics: OperatorMetrics,
        post_event: EventSink,
        logger: logging.Logger | logging.LoggerAdapter,
        resync_seconds: float = 60.0,
    ) -> None:
        self.kube = kube
        self.http = http
        self.resolver = resolver
        self.metrics = metrics
        self.post_event = post_event
        self.logger = logger
        # The status this supervisor last wrote: fresher than the watched body, which lags
        # behind our own patches (acting on a stale copy could count one death twice).
        self._written: dict[str, Any] | None = None
        self.resync_seconds = resync_seconds
        self._last_resync: dt.datetime | None = None

    async def tick(self, body: Mapping[str, Any], now: dt.datetime | None = None) -> float:
        """One round over every world; returns the seconds until the next one."""
        now = now or dt.datetime.now(dt.timezone.utc)
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        previous_status = self._written if self._written is not None else dict(body.get("status") or {})
        try:
            spec = parse_spec(body.get("spec"))
        except InvalidSpec as exc:
            conds, phase = conditions.summarise([], 0, invalid_spec=str(exc))
            await self._write_status(body, previous_status, [], conds, phase, 0, 0, now)
            return 30.0

        owner = render.Owner(name=name, namespace=namespace, uid=meta["uid"])
        reconciled = (body.get("status") or {}).get("observedGeneration") is not None
        await self._resync(owner, spec, reconciled, now)
        pods = await self.kube.list("v1", "Pod", namespace, {naming.DEPLOYMENT: name})
        by_name = {pod["metadata"]["name"]: pod for pod in pods}
        previous_worlds = {world.get("index"): world for world in previous_status.get("worlds") or []}

        world_list = list(range(spec.replicas))
        steps = await asyncio.gather(
            *(
                self._judge(owner, spec, index, by_name, pods, previous_worlds.get(index, {}), now)
                for index in world_list
            )
        )
        statuses = []
        for index, (step, replace_reason) in zip(world_list, steps):
            for event in step.events:
                self.post_event(*event)
            if replace_reason is not None:
                await self._replace_world(owner, spec, index, pods)
            elif step.restart is not None:
                self.metrics.world_restarts.labels(namespace, name, step.restart.reason).inc()
                self.logger.warning(f"restarting world {index}: {step.restart.reason}: {step.restart.error}")
                await self._replace_world(owner, spec, index, pods)
            elif reconciled and naming.launcher_pod_name(name, index) not in by_name:
                # Launchers are bare pods: this loop is their controller.
                await self._create_launcher(owner, spec, index)
            statuses.append(step.status)

        conds, phase = conditions.summarise(statuses, spec.replicas)
        ready = sum(1 for world in statuses if world.get("phase") == "Ready")
        self.metrics.set_world_phases(namespace, name, [world["phase"] for world in statuses])
        await self._write_status(body, previous_status, statuses, conds, phase, ready, spec.replicas, now)
        if any(world["phase"] not in SETTLED_PHASES for world in statuses):
            # A world on its way up (or down) is polled more often than a settled one.
            return float(min(spec.health.interval_seconds, FAST_INTERVAL))
        return float(spec.health.interval_seconds)

    async def _resync(
        self, owner: render.Owner, spec: LLMDeploymentSpec, reconciled: bool, now: dt.datetime
    ) -> None:
        """Every `resync_seconds`, the full reconcile: repairs drifted or deleted children.

        Not on the first round: the create/resume handler is reconciling at that moment.
        """
        if self._last_resync is None or not reconciled:
            self._last_resync = now
            return
        if (now - self._last_resync).total_seconds() < self.resync_seconds:
            return
        self._last_resync = now
        outcome = await reconcile.reconcile(self.kube, owner, spec, prune_extra=True)
        for event in outcome.events():
            self.post_event(*event)

    async def _judge(
        self,
        owner: render.Owner,
        spec: LLMDeploymentSpec,
        index: int,
        by_name: Mapping[str, Mapping[str, Any]],
        pods: list[dict[str, Any]],
        previous: Mapping[str, Any],
        now: dt.datetime,
    ) -> tuple[worlds.WorldStep, str | None]:
        launcher = by_name.get(naming.launcher_pod_name(owner.name, index))
        workers = [
            pod
            for pod in pods
            if pod["metadata"].get("labels", {}).get(naming.WORLD) == str(index)
            and pod["metadata"].get("labels", {}).get(naming.ROLE) == "worker"
        ]
        desired = render.launcher_pod(owner, spec, index)
        if launcher is not None and not launcher["metadata"].get("deletionTimestamp"):
            live_hash = (launcher["metadata"].get("annotations") or {}).get(naming.SPEC_HASH)
            if live_hash != desired["metadata"]["annotations"][naming.SPEC_HASH]:
                # The spec changed under a running world: replace it whole, which is not a
                # failure and does not spend the restart budget.
                status = {key: previous[key] for key in worlds.PERSISTENT if key in previous}
                status.update(
                    index=index,
                    launcherPod=desired["metadata"]["name"],
                    ready=False,
                    members={},
                    probeFailures=0,
                    phase="Restarting",
                    message="replacing the world's pods with the changed spec",
                )
                event = ("Normal", "WorldReplaced", f"world {index} replaced: its pod spec changed")
                return worlds.WorldStep(status=status, events=[event]), "SpecChanged"

        view = worlds.view_pods(
            owner.name, index, launcher, workers, spec.nodes_per_world, previous.get("members") or {}
        )
        result: Probe | None = None
        if view.running and view.failure is None and launcher is not None:
            address = await resolve(self.resolver, launcher)
            if address is not None:
                result = await probe(self.http, address, spec.health.timeout_seconds)
                self.metrics.probe_seconds.labels(result.status).observe(result.seconds)
        return worlds.step(index, previous, view, result, now, spec, owner.name), None

    async def _replace_world(
        self, owner: render.Owner, spec: LLMDeploymentSpec, index: int, pods: list[dict[str, Any]]
    ) -> None:
        """Delete the launcher and every worker pod together, then start a new launcher.

        The StatefulSet brings the workers back under the same names (stable host names, so
        the hostfile stays valid); the launcher is ours to recreate.
        """
        for pod in pods:
            labels = pod["metadata"].get("labels", {})
            if labels.get(naming.WORLD) == str(index) and labels.get(naming.ROLE) in ("launcher", "worker"):
                await self.kube.delete("v1", "Pod", owner.namespace, pod["metadata"]["name"])
        await self._create_launcher(owner, spec, index)

    async def _create_launcher(self, owner: render.Owner, spec: LLMDeploymentSpec, index: int) -> None:
        # Conflict: the old pod is still terminating; the next round tries again.
        with contextlib.suppress(Conflict):
            await self.kube.create(render.launcher_pod(owner, spec, index))

    async def _write_status(
        self,
        body: Mapping[str, Any],
        previous: Mapping[str, Any],
        world_statuses: list[dict[str, Any]],
        conds: list[dict[str, Any]],
        phase: str,
        ready: int,
        desired: int,
        now: dt.datetime,
    ) -> None:
        meta = body["metadata"]
        generation = meta.get("generation")
        new = {
            "worlds": world_statuses,
            "conditions": conditions.merge_conditions(previous.get("conditions"), conds, now, generation),
            "phase": phase,
            "readyReplicas": ready,
            "worldsReady": f"{ready}/{desired}",
        }
        if all(previous.get(key) == value for key, value in new.items()):
            return
        await self.kube.patch(
            API_VERSION, KIND, meta["namespace"], meta["name"], {"status": new}, subresource="status"
        )
        self._written = {**previous, **new}
