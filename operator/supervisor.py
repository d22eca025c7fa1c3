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
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from berth.operator import (
    conditions,
    disruption,
    engine_admin,
    gang,
    model_volume,
    naming,
    pod_template,
    reconcile,
    render,
    rollout,
    schedule,
    worlds,
)
from berth.operator.autoscale import Autoscaler, Decision, WorldLoad, effective_spec
from berth.operator.child_problems import ChildProblems, RefusedWrite, controlled_by, controller_of
from berth.operator.crd_model import API_VERSION, KIND, InvalidSpec, LLMDeploymentSpec, parse_spec
from berth.operator.credentials import unb64
from berth.operator.demand import DemandWatcher
from berth.operator.health import AddressResolver, EngineLoad, Probe, base_url, probe, resolve
from berth.operator.kube import Conflict, Kube, KubeError, NotFound
from berth.operator.metrics import OperatorMetrics
from berth.operator.restarts import RestartPolicy, format_time, parse_time
from berth.operator.watched import Expectations, Seen, WatchedChildren

SETTLED_PHASES = ("Ready", "Failed", "Sleeping")
FAST_INTERVAL = 2.0
# A sleep or wakeup the engine refused (or that could not reach it) is asked again after this.
TRANSITION_RETRY_SECONDS = 30.0
# Phases in which the engine answers its admin routes.
ANSWERING_PHASES = ("Ready", "NotReady", "Sleeping", "Waking")
# How often a deployment blocked by an object it does not control looks whether it is gone.
CONFLICT_RECHECK = 10.0
EventSink = Callable[[str, str, str], None]  # (type, reason, message)
Clock = Callable[[], dt.datetime]


def served_path(revision: str | None) -> str | None:
    """The model directory of a world's modelRevision (PATH@DIGEST)."""
    return revision.rpartition("@")[0] if revision and "@" in revision else None


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class OwnerGone(Exception):
    """The LLMDeployment this supervisor watches no longer exists (its status cannot be written)."""


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
        drift: reconcile.DriftMemory | None = None,
        clock: Clock = utc_now,
        wake: Callable[[], None] | None = None,
        problems: ChildProblems | None = None,
        children: WatchedChildren | None = None,
    ) -> None:
        self.kube = kube
        # Pods and StatefulSets from the watches (None: listed from the API server each round),
        # once the watches show this loop's own writes (watched.py).
        self.children = children
        self._expected = {kind: Expectations() for kind in ("Pod", "StatefulSet")}
        self._uids: dict[tuple[str, str], str] = {}  # (kind, name) -> uid, as last read
        # world -> (launcher's, workers' spec hash) as the spec renders them (see _desired_hashes).
        self._hashes: dict[int, tuple[str, str]] = {}
        self._hashes_of = ""  # the spec those are of, as JSON
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
        self.drift = drift if drift is not None else reconcile.DriftMemory()
        self.clock = clock
        # `wake`: start the next round now (a drain, wakeup or swap that ended is acted on at once).
        self.transitions = engine_admin.Transitions(on_end=wake)
        self._admin_token: str | None = None
        self._addresses: dict[int, tuple[str, int]] = {}  # world -> its launcher's address, this round
        self._polls: dict[int, Probe] = {}  # world -> its engine's answer, the latest round
        self.autoscaler = Autoscaler()
        # With an activator (a deployment that scales to zero): its demand wakes the next round.
        self.demand = DemandWatcher(http, wake or (lambda: None), logger)
        self._scheduling_orders: dict[int, str] = {}  # world -> release | resume, this round (gang.py)
        # Conflicting objects and refused writes, shared with the reconcile handler.
        self.problems = problems if problems is not None else ChildProblems()
        self.model_claim = model_volume.ClaimWatch()
        # False once the API server refused to show a Node: the namespaced install, which cannot
        # see a drain coming (disruption.py).
        self._may_read_nodes = True
        self._evicting: dict[int, list[str]] = {}  # world -> nodes its pods are evicted from, this round

    def close(self) -> None:
        """Stop waiting for transitions in flight (the engines finish them on their own; a
        resumed operator reads where they ended from the admission state)."""
        self.transitions.cancel_all()
        self.demand.close()

    async def tick(self, body: Mapping[str, Any], now: dt.datetime | None = None) -> float:
        """One round over every world; returns the seconds until the next one."""
        now = now or self.clock()
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        previous_status = self._written if self._written is not None else dict(body.get("status") or {})
        refusal = (body.get("status") or {}).get("refusal") or {}
        try:
            spec = parse_spec(body.get("spec"), name)
            if refusal.get("generation") == meta.get("generation") and refusal.get("message"):
                raise InvalidSpec(refusal["message"])
        except InvalidSpec as exc:
            # observedGeneration too: the refusal is this generation's answer (Argo CD: Degraded).
            conds, phase = conditions.summarise([], 0, invalid_spec=str(exc))
            await self._write_status(
                body,
                previous_status,
                [],
                conds,
                phase,
                0,
                0,
                now,
                {"observedGeneration": meta.get("generation")},
            )
            return 30.0
        evaluation = schedule.evaluate(spec, previous_status.get("sleepSchedule"), now)
        intent = evaluation.intent

        owner = render.Owner(name=name, namespace=namespace, uid=meta["uid"])
        reconciled = (body.get("status") or {}).get("observedGeneration") is not None
        # The reconcile handler has acted on this very generation (it sets observedGeneration).
        reconciled_now = (body.get("status") or {}).get("observedGeneration") == meta.get("generation")
        spec, scaled = await self._autoscale(owner, spec, previous_status, reconciled, now)
        released = gang.released_worlds(previous_status.get("worlds") or [], now)
        await self._resync(owner, spec, reconciled, now, released)
        pods = await self._own_pods(owner)
        nodes = await self._nodes(pods)
        lost = await disruption.release_from_lost_nodes(self.kube, pods, now, nodes)
        for pod_name in lost:
            self.post_event(
                "Warning",
                "PodOnLostNode",
                f"pod {pod_name} was terminating on a node that does not answer: deleted with grace period 0",
            )
        if lost:  # gone now, whatever the watches have delivered yet
            for pod_name in lost:
                self._expect(f"Pod/{pod_name}", "delete")
            pods = [pod for pod in pods if pod["metadata"]["name"] not in lost]
        by_name = {pod["metadata"]["name"]: pod for pod in pods}
        previous_worlds = {world.get("index"): world for world in previous_status.get("worlds") or []}
        token = await self._token(owner)
        finished = {world: (purpose, outcome) for world, purpose, outcome in self.transitions.finished()}
        drain_memory = (previous_status.get("disruption") or {}).get("inFlight") or []
        self._evicting = {
            entry["world"]: list(entry.get("nodes") or [])
            for entry in drain_memory
            if entry["step"] == "evicting"
        }

        world_list = list(range(spec.replicas))
        steps = await asyncio.gather(
            *(
                self._judge(owner, spec, index, by_name, pods, previous_worlds.get(index, {}), now, token)
                for index in world_list
            )
        )
        statuses = []
        orders: dict[int, tuple[str, list[str]]] = {}  # world -> (replace | create, pods to delete)
        for index, (step, _, _) in zip(world_list, steps):
            if (pool := spec.pool_of(index)) is not None:
                step.status["pool"] = pool
            scheduling = self._scheduling_orders.pop(index, None)
            if step.restart is not None:
                self._order_replacement(index, step, pods, orders)
            elif step.status.get("replacedPods"):
                orders[index] = ("replace", step.status.pop("replacingNow"))
            elif scheduling is not None:
                orders[index] = (scheduling, [])  # release (no room for all its pods) or resume
            elif (
                reconciled
                and step.status.get("phase") not in ("Unschedulable", "Evicting")
                and naming.launcher_pod_name(name, index) not in by_name
                and gang.launcher_may_start(spec, index, self._world_pods(index, pods, "worker"))
                and self._may_create_launcher(owner, index, now)
            ):
                # Launchers are bare pods: this loop is their controller.
                orders[index] = ("create", [])
            if index in finished:
                self._record_outcome(owner, index, step.status, *finished[index], now)
            statuses.append(step.status)

        # Worlds on drained nodes move off them, parked first, a few at a time (disruption.py).
        drained = await self._move_off_drained_nodes(
            owner, spec, steps, pods, nodes, orders, drain_memory, previous_status, now
        )
        draining_worlds = {entry["world"] for entry in drained.in_flight}

        # The rollout takes the worlds whose pods run an outdated spec, a few at a time.
        target = render.pod_specs_digest(owner, spec)
        world_states = [
            rollout.WorldState(
                index=index,
                ready=bool(step.status.get("ready")),
                phase=str(step.status.get("phase")),
                admission=step.status.get("admission"),
                outdated=None if index in orders or index in draining_worlds else outdated,
                busy=self.transitions.busy(index),
                idle=scaled is not None and index in scaled.asleep,
            )
            for index, (step, _, outdated) in zip(world_list, steps)
        ]
        refused = {
            index: outcome.message
            for index, (purpose, outcome) in finished.items()
            if purpose == "swap" and outcome.kind == "swap" and outcome.result == "refused"
        }
        rolling = rollout.plan(
            world_states,
            previous_status.get("rollout"),
            target,
            spec.rollout.max_unavailable,
            now,
            spec.rollout.drain_timeout_seconds,
            spec.health.startup_timeout_seconds,
            refused,
            asleep=intent.asleep,
        )
        for event in rolling.events:
            self.post_event(*event)
        for index, order in rolling.orders:
            self._carry_out(owner, spec, index, order, steps[index][0], pods, orders, steps[index][2])
        in_rollout = {entry["world"] for entry in rolling.memory["inFlight"]}
        for index, (step, _, _) in zip(world_list, steps):
            world_intent = intent
            if scaled is not None:
                step.status["tier"] = scaled.tier(index)
                if index in scaled.asleep and not intent.asleep:
                    world_intent = schedule.SleepIntent(
                        True, spec.autoscaling.idle.level, "autoscaling (idle)"
                    )
            if index not in orders and index not in in_rollout and index not in draining_worlds:
                self._steer_sleep(spec, world_intent, index, step, by_name, owner, now)
        self.metrics.set_rollout(namespace, name, rolling.memory, spec.replicas)
        if spec.scales_to_zero:
            await self._tell_activator(owner, statuses, finished)
        retiring = await self._retire_worlds(owner, spec, pods, previous_worlds, finished, token, now)

        for world_status in statuses:
            errors = self.problems.world_errors(world_status["index"])
            if errors:
                world_status["apiErrors"] = errors
        conflicts = [conflict.describe() for _, conflict in sorted(self.problems.conflicts.items())]
        summarised, desired, summary_intent = statuses, spec.replicas, intent
        if scaled is not None and scaled.asleep and not intent.asleep:
            # Worlds asleep for idleness are where they belong: the others are judged alone.
            summarised = [world for world in statuses if world["index"] not in scaled.asleep]
            desired = len(summarised)
            if not summarised:
                summarised, desired = statuses, spec.replicas
                summary_intent = schedule.SleepIntent(True, spec.autoscaling.idle.level, "autoscaling (idle)")
        conds, phase = conditions.summarise(
            summarised,
            desired,
            sleep=summary_intent,
            retiring=retiring,
            conflicts=conflicts,
            rollout=rolling.memory,
            reconciled=reconciled_now,
        )
        conds.append(pod_template.deprecation_condition(spec))  # a warning: nothing is refused
        claim = await self.model_claim.read(self.kube, namespace, spec, now)
        conds.append(model_volume.condition(spec, claim))  # a warning too
        ready = sum(1 for world in statuses if world.get("phase") == "Ready")
        self.metrics.set_world_phases(namespace, name, [world["phase"] for world in statuses])
        self.metrics.set_worlds(
            namespace, name, statuses, RestartPolicy.from_spec(spec.health), rolling.memory, now
        )
        extra = {
            "sleepSchedule": evaluation.memory,
            "nextTransition": evaluation.next_transition,
            "modelRevision": self._model_revision(statuses),
            "rollout": rolling.memory,
            "conflicts": self.problems.conflicts_status() or None,
            "apiErrors": self.problems.deployment_errors() or None,
            "replicas": spec.replicas,
            "autoscaling": scaled.status if scaled is not None else None,
            "disruption": {"inFlight": drained.in_flight} if drained.in_flight else None,
        }
        # Status first, then the pods: a restart is counted (and its backoff started) before any
        # pod goes, so a failed status write can never make one death count twice.
        await self._write_status(
            body, previous_status, statuses + retiring, conds, phase, ready, spec.replicas, now, extra
        )
        self.metrics.round_done(namespace, name)
        for (step, _, _), world_status in zip(steps, statuses):
            for event in step.events:
                self.post_event(*event)
            if step.restart is not None:
                self.metrics.world_restarts.labels(namespace, name, step.restart.reason).inc()
                self.logger.warning(
                    f"restarting world {world_status['index']}: {step.restart.reason}: {step.restart.error}"
                )
        for index, (action, doomed_names) in sorted(orders.items()):
            if action == "replace":
                await self._replace_world(owner, spec, index, doomed_names, now)
            elif action in ("release", "resume"):
                await self._release_world(owner, spec, index, action == "release", now)
            else:
                await self._create_launcher(owner, spec, index, now)
        interval = float(spec.health.interval_seconds)
        if (
            retiring
            or self.transitions.tasks
            or any(world["phase"] not in SETTLED_PHASES for world in statuses)
        ):
            # A world on its way up (or down) is polled more often than a settled one.
            interval = min(interval, FAST_INTERVAL)
        self.problems.forget_worlds_from(spec.replicas)
        retry = self.problems.seconds_until_retry(now)
        if retry is not None:
            interval = min(interval, retry + 0.01)  # a refused write is tried again at its time
        until = schedule.seconds_until(evaluation.next_transition, now)
        if until is not None:
            # Wake up for the next scheduled transition: it happens at its time, not a poll later.
            interval = min(interval, until + 0.01)
        return interval

    async def _autoscale(
        self,
        owner: render.Owner,
        spec: LLMDeploymentSpec,
        previous: Mapping[str, Any],
        reconciled: bool,
        now: dt.datetime,
    ) -> tuple[LLMDeploymentSpec, Decision | None]:
        """The spec with the worlds autoscaling wants (from the previous round's polls), and its
        decision. New worlds are built at once (the reconcile's path); surplus ones retire (drained
        by sleep, then removed) as on any scale-down."""
        if spec.autoscaling is None:
            return spec, None
        current = effective_spec(spec, previous)
        phases = {world.get("index"): world.get("phase") for world in previous.get("worlds") or []}
        loads = []
        for index in range(current.replicas):
            poll = self._polls.get(index)
            alive = poll is not None and poll.status == "alive"
            load = poll.load if alive and poll.load is not None else EngineLoad()
            loads.append(
                WorldLoad(
                    index=index,
                    serving=alive and poll.ready and poll.admission == "running",
                    settled=phases.get(index) in SETTLED_PHASES,
                    num_running=load.num_running,
                    num_waiting=load.num_waiting,
                    kv_cache_usage=load.kv_cache_usage,
                    computed_tokens=load.computed_tokens if alive and poll.load is not None else None,
                )
            )
        held = self.demand.held if spec.scales_to_zero else 0
        decision = self.autoscaler.decide(
            spec.autoscaling, spec.replicas, loads, previous.get("autoscaling"), now, held
        )
        for event in decision.events:
            self.post_event(*event)
        self.metrics.set_autoscaling(owner.namespace, owner.name, decision.status)
        for index in [index for index in self._polls if index >= decision.worlds]:
            del self._polls[index]  # a world built again later is polled anew
        wanted = spec.model_copy(update={"replicas": decision.worlds})
        if decision.worlds > current.replicas and reconciled:
            outcome = await reconcile.reconcile(
                self.kube, owner, wanted, prune_extra=False, drift=self.drift, seen=self._seen(owner)
            )
            for event in outcome.events() + outcome.record(self.problems, now):
                self.post_event(*event)
        return wanted, decision

    async def _tell_activator(
        self,
        owner: render.Owner,
        statuses: list[dict[str, Any]],
        finished: Mapping[int, tuple[str, engine_admin.TransitionOutcome]],
    ) -> None:
        """The activator learns which worlds serve (it forwards its held requests there) and why
        a wake failed (each held request gets that error)."""
        deployment = await self.kube.get(
            "apps/v1", "Deployment", owner.namespace, naming.activator_name(owner.name)
        )
        pods = [
            pod
            for pod in (await self._children("v1", "Pod", owner) if deployment else [])
            if (pod["metadata"].get("labels") or {}).get(naming.ROLE) == "activator"
        ]
        ours = deployment is not None and controlled_by(deployment, owner.uid)
        running = [
            pod
            for pod in pods
            if ours
            and (pod.get("status") or {}).get("podIP")
            and not pod["metadata"].get("deletionTimestamp")
        ]
        address = (running[0]["status"]["podIP"], naming.ACTIVATOR_ADMIN_PORT) if running else None
        serving = [
            base_url(self._addresses[world["index"]])
            for world in statuses
            if world.get("phase") == "Ready" and world["index"] in self._addresses
        ]
        wake_failures = [
            f"world {index}: {outcome.kind} {outcome.result}: {outcome.message}"
            for index, (purpose, outcome) in sorted(finished.items())
            if purpose == "wake" and not outcome.ok and outcome.result != "conflict"
        ]
        failed_worlds = [
            f"world {world['index']} failed: {world.get('lastEngineError') or world.get('message')}"
            for world in statuses
            if world.get("phase") == "Failed"
        ]
        failure = None
        if not serving and wake_failures:
            failure = "; ".join(wake_failures)
        elif not serving and statuses and len(failed_worlds) == len(statuses):
            failure = "; ".join(failed_worlds)  # out of restarts: nothing will come up soon
        self.demand.update(address, serving, failure, self._admin_token)

    async def _retire_worlds(
        self,
        owner: render.Owner,
        spec: LLMDeploymentSpec,
        pods: list[dict[str, Any]],
        previous_worlds: Mapping[int, Mapping[str, Any]],
        finished: Mapping[int, tuple[str, engine_admin.TransitionOutcome]],
        token: str | None,
        now: dt.datetime,
    ) -> list[dict[str, Any]]:
        """Scale-down: drain each world beyond `replicas` (sleep, mode drain), then delete its
        launcher and prune the rest. Returns their statuses (phase Retiring) while they drain.

        Nothing here needs memory of its own: after an operator restart a world still parking
        is waited for, a parked one removed, one still running drained again."""
        launchers = [
            pod for pod in pods if (pod["metadata"].get("labels") or {}).get(naming.ROLE) == "launcher"
        ]
        statuses = []
        removed = False
        for index in sorted(reconcile.retiring_worlds(spec, launchers)):
            launcher_name = naming.launcher_pod_name(owner.name, index)
            launcher = next(pod for pod in launchers if pod["metadata"]["name"] == launcher_name)
            status: dict[str, Any] = {
                key: previous_worlds[index][key]
                for key in ("restarts", "modelRevision", "lastTransition")
                if key in previous_worlds.get(index, {})
            }
            status.update(index=index, launcherPod=launcher_name, ready=False, phase="Retiring")
            ended = finished.get(index)
            if ended is not None:
                self._record_outcome(owner, index, status, *ended, now)
            if self.transitions.busy(index):
                status["message"] = "draining requests in flight before the world is removed (scale-down)"
                statuses.append(status)
                continue
            address = (
                await resolve(self.resolver, launcher)
                if (launcher.get("status") or {}).get("podIP")
                else None
            )
            result = await probe(self.http, address, spec.health.timeout_seconds, token) if address else None
            admission = result.admission if result is not None and result.status == "alive" else None
            drained = ended is not None and ended[0] == "retire" and ended[1].result != "conflict"
            if admission == "running" and not drained:
                self.post_event(
                    "Normal",
                    "WorldDraining",
                    f"world {index}: draining (up to {spec.rollout.drain_timeout_seconds}s) before removal: "
                    f"replicas is {spec.replicas}",
                )
                call = engine_admin.sleep(self.http, address, token, 1, spec.rollout.drain_timeout_seconds)
                self.transitions.start(index, "sleep", "retire", call)
                status.update(admission=admission, message="draining requests in flight before removal")
                statuses.append(status)
                continue
            if admission in ("parking", "waking"):
                status.update(
                    admission=admission, message=f"waiting for the engine ({admission}) before removal"
                )
                statuses.append(status)
                continue
            # Parked, drained, never up, or dead: nothing in flight to wait for.
            deletion = self._delete_pod(owner, spec, launcher_name)
            if await self._write(index, f"Pod/{launcher_name}", "delete", now, deletion):
                self.post_event(
                    "Normal", "WorldRemoved", f"world {index} removed: replicas is {spec.replicas}"
                )
                removed = True
        if removed:
            outcome = reconcile.Outcome()
            await reconcile.prune(self.kube, owner, spec, outcome)
            for event in outcome.events():
                self.post_event(*event)
        return statuses

    async def _token(self, owner: render.Owner) -> str | None:
        """The admin token the engines of this deployment accept (its Secret is never rotated)."""
        if self._admin_token is None:
            secret = await self.kube.get(
                "v1", "Secret", owner.namespace, naming.admin_token_secret(owner.name)
            )
            if secret is None or not controlled_by(secret, owner.uid):
                # Someone else's Secret of that name is never read: its value would go, as a
                # bearer token, to whatever pod answers at a launcher's address.
                return None
            token = ((secret or {}).get("data") or {}).get("token")
            self._admin_token = unb64(token) if token else None
        return self._admin_token

    @staticmethod
    def _model_revision(statuses: list[dict[str, Any]]) -> str | None:
        """The revision every world serves; while they differ (a rollout), each one, by world."""
        revisions = {world["index"]: world.get("modelRevision") for world in statuses}
        known = sorted({revision for revision in revisions.values() if revision})
        if not known:
            return None
        if len(known) == 1 and all(revisions.values()):
            return known[0]
        return "; ".join(
            f"world {index}: {revision or 'unknown'}" for index, revision in sorted(revisions.items())
        )

    def _record_outcome(
        self,
        owner: render.Owner,
        index: int,
        status: dict[str, Any],
        purpose: str,
        outcome: engine_admin.TransitionOutcome,
        now: dt.datetime,
    ) -> None:
        """A transition that ended: the world's lastTransition, an Event, the metrics."""
        self.metrics.transitions.labels(
            owner.namespace, owner.name, outcome.kind, purpose, outcome.result
        ).inc()
        if outcome.result == "conflict":
            return  # the engine is already there or on its way: nothing happened, nothing to report
        self.metrics.transition_seconds.labels(outcome.kind).observe(outcome.seconds)
        status["lastTransition"] = {
            "kind": outcome.kind,
            "purpose": purpose,
            "result": outcome.result,
            "message": outcome.message,
            "time": format_time(now),
        }
        if outcome.ok:
            aborted = (
                f", {outcome.num_aborted} request(s) aborted at the drain timeout"
                if outcome.num_aborted
                else ""
            )
            reason = {"sleep": "WorldAsleep", "wakeup": "WorldAwake", "swap": "WeightsSwapped"}[outcome.kind]
            self.post_event("Normal", reason, f"world {index}: {outcome.message}{aborted} ({purpose})")
        else:
            reason = {"sleep": "SleepFailed", "wakeup": "WakeupFailed", "swap": "WeightSwapFailed"}[
                outcome.kind
            ]
            self.post_event(
                "Warning", reason, f"world {index}: {outcome.kind} {outcome.result}: {outcome.message}"
            )

    def _order_replacement(
        self,
        index: int,
        step: worlds.WorldStep,
        pods: list[dict[str, Any]],
        orders: dict[int, tuple[str, list[str]]],
    ) -> None:
        """Replace the world's pods. They go into status with the order: if deleting them fails
        half-way, the next round finishes the job instead of counting a new death."""
        doomed = self._world_pods(index, pods)
        step.status["replacedPods"] = sorted(pod["metadata"]["uid"] for pod in doomed)
        orders[index] = ("replace", [pod["metadata"]["name"] for pod in doomed])

    async def _nodes(self, pods: list[dict[str, Any]]) -> dict[str, Mapping[str, Any] | None] | None:
        """The Nodes of the deployment's pods; None where this install may not read them."""
        if not self._may_read_nodes:
            return None
        names = {(pod.get("spec") or {}).get("nodeName") for pod in pods} - {None}
        nodes = await disruption.read_nodes(self.kube, names)  # type: ignore[arg-type]
        self._may_read_nodes = nodes is not None
        return nodes

    async def _move_off_drained_nodes(
        self,
        owner: render.Owner,
        spec: LLMDeploymentSpec,
        steps: list[tuple[worlds.WorldStep, None, str | None]],
        pods: list[dict[str, Any]],
        nodes: Mapping[str, Mapping[str, Any] | None] | None,
        orders: dict[int, tuple[str, list[str]]],
        memory: list[dict[str, Any]],
        previous_status: Mapping[str, Any],
        now: dt.datetime,
    ) -> disruption.DrainPlan:
        """Plan and carry out this round's drain orders; returns the plan (its memory for status)."""
        in_rollout = {
            entry["world"] for entry in (previous_status.get("rollout") or {}).get("inFlight") or []
        }
        written = {world.get("index"): world for world in previous_status.get("worlds") or []}
        drained = disruption.plan(
            [
                self._world_on_nodes(
                    index,
                    step,
                    pods,
                    nodes,
                    busy=self.transitions.busy(index),
                    elsewhere=index in orders or index in in_rollout,
                    written=written.get(index) or {},
                )
                for index, (step, _, _) in enumerate(steps)
            ],
            memory,
            spec.rollout.max_unavailable,
            now,
            spec.rollout.drain_timeout_seconds,
        )
        for event in drained.events:
            self.post_event(*event)
        for index, order, leaving in drained.orders:
            await self._carry_out_drain(
                owner, spec, index, order, leaving, steps[index][0], pods, orders, now
            )
        for entry in drained.in_flight:
            if entry["step"] == "parking":
                steps[entry["world"]][0].status["message"] = (
                    f"parking: {', '.join(entry['nodes'])} is being drained; its pods go once it is parked"
                )
        return drained

    def _world_on_nodes(
        self,
        index: int,
        step: worlds.WorldStep,
        pods: list[dict[str, Any]],
        nodes: Mapping[str, Mapping[str, Any] | None] | None,
        busy: bool,
        elsewhere: bool,
        written: Mapping[str, Any],
    ) -> disruption.WorldOnNodes:
        held = {
            pod["spec"]["nodeName"] for pod in self._world_pods(index, pods) if pod["spec"].get("nodeName")
        }
        draining = {name for name in held if nodes is not None and disruption.node_draining(nodes.get(name))}
        live = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in self._world_pods(index, pods)}
        members = step.status.get("members") or {}
        whole = all(live.get(name) == identity.partition("/")[0] for name, identity in members.items())
        admission = step.status.get("admission")
        if admission == "parked" and written.get("admission") != "parked":
            # Parked once the status says so: who watches the deployment sees the world parked
            # before the drain may take its pods (released next round, after this one's write).
            admission = "parking"
        return disruption.WorldOnNodes(
            index=index,
            ready=bool(step.status.get("ready")),
            phase=str(step.status.get("phase")),
            admission=admission,
            busy=busy,
            nodes=frozenset(held),
            draining=frozenset(draining),
            elsewhere=elsewhere,
            whole=whole,
        )

    async def _carry_out_drain(
        self,
        owner: render.Owner,
        spec: LLMDeploymentSpec,
        index: int,
        order: disruption.Order,
        leaving: tuple[str, ...],
        step: worlds.WorldStep,
        pods: list[dict[str, Any]],
        orders: dict[int, tuple[str, list[str]]],
        now: dt.datetime,
    ) -> None:
        """One drain order for world `index` (`leaving`: the drained nodes it holds pods on)."""
        if order == "park":
            address = self._addresses.get(index)
            if address is not None and not self.transitions.busy(index):
                call = engine_admin.sleep(
                    self.http, address, self._admin_token, 1, spec.rollout.drain_timeout_seconds
                )
                self.transitions.start(index, "sleep", "drain", call)
        elif order == "release":
            # Out of the world's PodDisruptionBudget: the drain's next eviction of each goes through.
            await self._label_evictable(owner, index, pods, leaving, "true", now)
        elif order == "abort":
            # The node stays: the world's pods are protected again; the sleep steering wakes it.
            await self._label_evictable(owner, index, pods, None, None, now)
        elif index not in orders:  # replace
            # What is left of the world as it ran (a worker its StatefulSet made again is new already).
            members = step.status.get("members") or {}
            doomed = [
                pod
                for pod in self._world_pods(index, pods)
                if members.get(pod["metadata"]["name"], "").partition("/")[0] == pod["metadata"]["uid"]
            ]
            message = f"replacing the world on other nodes: {', '.join(leaving)} is being drained"
            step.status.update(phase="Restarting", ready=False, members={}, probeFailures=0, message=message)
            step.status["replacedPods"] = sorted(pod["metadata"]["uid"] for pod in doomed)
            orders[index] = ("replace", [pod["metadata"]["name"] for pod in doomed])

    async def _label_evictable(
        self,
        owner: render.Owner,
        index: int,
        pods: list[dict[str, Any]],
        on_nodes: tuple[str, ...] | None,
        value: str | None,
        now: dt.datetime,
    ) -> None:
        """Set (`value` "true") or remove (None) `berth.dev/evictable` on the world's pods (those on
        `on_nodes`, or all) whose label differs."""
        for pod in self._world_pods(index, pods):
            name = pod["metadata"]["name"]
            if on_nodes is not None and pod["spec"].get("nodeName") not in on_nodes:
                continue
            if (pod["metadata"].get("labels") or {}).get(naming.EVICTABLE) == value:
                continue
            patch = {"metadata": {"labels": {naming.EVICTABLE: value}}}
            call = self.kube.patch("v1", "Pod", owner.namespace, name, patch)
            await self._write(index, f"Pod/{name}", "patch", now, call)

    def _carry_out(
        self,
        owner: render.Owner,
        spec: LLMDeploymentSpec,
        index: int,
        order: rollout.Order,
        step: worlds.WorldStep,
        pods: list[dict[str, Any]],
        orders: dict[int, tuple[str, list[str]]],
        outdated: str | None,
    ) -> None:
        """One rollout order for world `index` (`outdated`: which of its pod specs changed)."""
        address = self._addresses.get(index)
        drain = spec.rollout.drain_timeout_seconds
        if order == "replace":
            if index in orders:
                return  # a restart or a creation already takes care of its pods this round
            # Not a failure: the restart budget is not spent.
            step.status.update(
                phase="Restarting",
                ready=False,
                members={},
                probeFailures=0,
                message="replacing the world's pods for the new spec (rollout)",
            )
            self._order_replacement(index, step, pods, orders)
            self.post_event(
                "Normal",
                "WorldReplaced",
                f"world {index} replaced: its StatefulSet's immutable fields changed"
                if outdated == "statefulset"
                else f"world {index} replaced: its {outdated or 'launcher'} pod spec changed",
            )
            return
        if address is None or self.transitions.busy(index):
            return
        token = self._admin_token
        if order == "drain":
            call = engine_admin.sleep(self.http, address, token, 1, drain)
            self.transitions.start(index, "sleep", "rollout", call)
        elif order == "swap-sleep":
            # Level 2: the old weights go; the wakeup loads the new ones in the same processes.
            self.transitions.start(
                index, "sleep", "swap", engine_admin.sleep(self.http, address, token, 2, drain)
            )
        elif order == "swap-wake":
            timeout = spec.health.startup_timeout_seconds
            call = engine_admin.wakeup(
                self.http, address, token, timeout, model=spec.model.path, revision=spec.model.revision
            )
            self.transitions.start(index, "swap", "swap", call)
        elif order == "wake":
            call = engine_admin.wakeup(self.http, address, token, spec.health.startup_timeout_seconds)
            self.transitions.start(index, "wakeup", "wake", call)

    def _steer_sleep(
        self,
        spec: LLMDeploymentSpec,
        intent: schedule.SleepIntent,
        index: int,
        step: worlds.WorldStep,
        by_name: Mapping[str, Mapping[str, Any]],
        owner: render.Owner,
        now: dt.datetime,
    ) -> None:
        """Start the sleep or wakeup that brings world `index` where the intent wants it."""
        status = step.status
        if self.transitions.busy(index) or status.get("phase") not in ANSWERING_PHASES:
            return
        last = status.get("lastTransition") or {}
        if (
            last.get("result") not in (None, "done")
            and (now - parse_time(last["time"])).total_seconds() < TRANSITION_RETRY_SECONDS
        ):
            return  # it failed a moment ago: not again on every poll
        launcher = by_name.get(naming.launcher_pod_name(owner.name, index))
        address = self._addresses.get(index)
        if launcher is None or address is None:
            return
        admission = status.get("admission")
        if intent.asleep and admission == "running":
            self.post_event(
                "Normal",
                "Sleeping",
                f"world {index}: sleeping at level {intent.level} ({intent.source}); requests in flight "
                f"get up to {spec.rollout.drain_timeout_seconds}s to finish",
            )
            call = engine_admin.sleep(
                self.http, address, self._admin_token, intent.level, spec.rollout.drain_timeout_seconds
            )
            self.transitions.start(index, "sleep", "sleep", call)
        elif not intent.asleep and admission == "parked":
            self.post_event(
                "Normal", "Waking", f"world {index}: waking up (nothing asks it to sleep any more)"
            )
            call = engine_admin.wakeup(
                self.http, address, self._admin_token, spec.health.startup_timeout_seconds
            )
            self.transitions.start(index, "wakeup", "wake", call)

    async def _resync(
        self,
        owner: render.Owner,
        spec: LLMDeploymentSpec,
        reconciled: bool,
        now: dt.datetime,
        released: frozenset[int] = frozenset(),
    ) -> None:
        """Every `resync_seconds`, the full reconcile: repairs drifted or deleted children.

        Not on the first round: the create/resume handler is reconciling at that moment.
        """
        if self._last_resync is None or not reconciled:
            self._last_resync = now
            return
        since = (now - self._last_resync).total_seconds()
        # A refused write's retry is due, or an object in the way may have gone (looked at more
        # often than the resync, so the deployment goes on soon after someone removes it).
        due = self.problems.reconcile_due(now) or (self.problems.conflicts and since >= CONFLICT_RECHECK)
        if not due and since < self.resync_seconds:
            return
        self._last_resync = now
        outcome = await reconcile.reconcile(
            self.kube,
            owner,
            spec,
            prune_extra=True,
            drift=self.drift,
            released=released,
            seen=self._seen(owner),
        )
        for event in outcome.events() + outcome.record(self.problems, now):
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
        token: str | None = None,
    ) -> tuple[worlds.WorldStep, str | None, str | None]:
        blocking = self.problems.world_conflicts(index)
        if blocking:
            # Nothing of this world is touched or polled while an object in its way is someone else's.
            status = {key: previous[key] for key in worlds.PERSISTENT if key in previous}
            status.update(
                index=index,
                launcherPod=naming.launcher_pod_name(owner.name, index),
                ready=False,
                phase="Blocked",
                message="; ".join(conflict.describe() for conflict in blocking),
            )
            return worlds.WorldStep(status=status), None, None
        launcher = by_name.get(naming.launcher_pod_name(owner.name, index))
        workers = [
            pod
            for pod in pods
            if pod["metadata"].get("labels", {}).get(naming.WORLD) == str(index)
            and pod["metadata"].get("labels", {}).get(naming.ROLE) == "worker"
        ]
        if index in self._evicting:
            # Parked, and a drain evicts its pods: their going is the plan, not the world's death.
            status = {key: previous[key] for key in worlds.PERSISTENT if key in previous}
            status.update(
                index=index,
                launcherPod=naming.launcher_pod_name(owner.name, index),
                ready=False,
                phase="Evicting",
                admission=previous.get("admission"),
                message=(
                    f"parked; its pods on {', '.join(self._evicting[index])} are being evicted (node drain), "
                    "then it is replaced on other nodes"
                ),
            )
            return worlds.WorldStep(status=status), None, None
        unfinished = self._unfinished_replacement(index, previous, pods)
        if unfinished:
            # A restart whose status was written but whose pods were not all deleted: finish it.
            status = {key: previous[key] for key in (*worlds.PERSISTENT, "replacedPods") if key in previous}
            status.update(
                index=index,
                launcherPod=naming.launcher_pod_name(owner.name, index),
                ready=False,
                phase="Restarting",
                message="deleting the pods of the world being restarted",
                replacingNow=unfinished,
            )
            return worlds.WorldStep(status=status), None, None
        view = worlds.view_pods(
            owner.name, index, launcher, workers, spec.nodes_of(index), previous.get("members") or {}
        )
        result: Probe | None = None
        self._addresses.pop(index, None)
        self._polls.pop(index, None)
        if view.running and view.failure is None and launcher is not None:
            address = await resolve(self.resolver, launcher)
            if address is not None:
                self._addresses[index] = address
                result = await probe(self.http, address, spec.health.timeout_seconds, token)
                self.metrics.probe_seconds.labels(result.status).observe(result.seconds)
                self._polls[index] = result
        step = worlds.step(index, previous, view, result, now, spec, owner.name)
        if step.restart is None:
            judged = gang.judge(step.status, previous, launcher, workers, spec, owner.name, index, now)
            step = worlds.WorldStep(
                judged.status, None, step.events + ([judged.event] if judged.event else [])
            )
            if judged.order is not None:
                self._scheduling_orders[index] = judged.order
        outdated = await self._changed_pod_spec(owner, spec, index, launcher, workers)
        if (
            outdated == "launcher"
            and spec.rollout.in_place_weight_swap
            and self._only_model_differs(owner, spec, index, launcher)
        ):
            outdated = "model"
        if (
            outdated == "model"
            and served_path(step.status.get("modelRevision")) == spec.model.path
            and step.status.get("modelRevisionLabel") == spec.model.revision
        ):
            outdated = None  # swapped in place already: the pod's command names the old weights
        if outdated is None and self.problems.immutable_statefulset(naming.world_name(owner.name, index)):
            # The API server will not patch its StatefulSet (a field that never changes differs):
            # the world is drained and its StatefulSet replaced, like any rollout.
            outdated = "statefulset"
        return step, None, outdated

    @staticmethod
    def _world_pods(index: int, pods: list[dict[str, Any]], *roles: str) -> list[dict[str, Any]]:
        """The pods of one world (launcher and workers unless `roles` says) not already going away."""
        return [
            pod
            for pod in pods
            if pod["metadata"].get("labels", {}).get(naming.WORLD) == str(index)
            and pod["metadata"].get("labels", {}).get(naming.ROLE) in (roles or ("launcher", "worker"))
            and not pod["metadata"].get("deletionTimestamp")
        ]

    def _unfinished_replacement(
        self, index: int, previous: Mapping[str, Any], pods: list[dict[str, Any]]
    ) -> list[str]:
        """Names of pods a recorded restart was to delete that still stand."""
        doomed = set(previous.get("replacedPods") or [])
        return [
            pod["metadata"]["name"]
            for pod in self._world_pods(index, pods)
            if pod["metadata"]["uid"] in doomed
        ]

    @staticmethod
    def _only_model_differs(
        owner: render.Owner, spec: LLMDeploymentSpec, index: int, launcher: Mapping[str, Any] | None
    ) -> bool:
        """True when the launcher pod would be current but for `model.path` and `model.revision`
        (a weight swap)."""
        if launcher is None:
            return False
        path, label = render.launcher_model(launcher["spec"]["containers"][0].get("command") or [])
        if path is None or (path, label) == (spec.model.path, spec.model.revision):
            return False
        model = spec.model.model_copy(update={"path": path, "revision": label})
        as_before = spec.model_copy(update={"model": model})
        wanted = render.launcher_pod(owner, as_before, index)["metadata"]["annotations"][naming.SPEC_HASH]
        return (launcher["metadata"].get("annotations") or {}).get(naming.SPEC_HASH) == wanted

    def _desired_hashes(self, owner: render.Owner, spec: LLMDeploymentSpec, index: int) -> tuple[str, str]:
        """The spec hashes of world `index`'s launcher and worker pods as `spec` renders them.
        Rendered once per spec, not every round: a rendering merges the pod template (deep
        copies), and every world of every deployment is judged every few seconds."""
        spec_json = spec.model_dump_json()
        if spec_json != self._hashes_of:
            self._hashes, self._hashes_of = {}, spec_json
        if index not in self._hashes:
            launcher = render.launcher_pod(owner, spec, index)["metadata"]["annotations"][naming.SPEC_HASH]
            self._hashes[index] = (launcher, render.spec_hash(render.worker_pod_spec(owner, spec, index)))
        return self._hashes[index]

    async def _changed_pod_spec(
        self,
        owner: render.Owner,
        spec: LLMDeploymentSpec,
        index: int,
        launcher: Mapping[str, Any] | None,
        workers: list[dict[str, Any]],
    ) -> str | None:
        """'launcher' or 'worker' when a running pod of the world runs an outdated pod spec."""
        desired, wanted = self._desired_hashes(owner, spec, index)
        if (
            launcher is not None
            and not launcher["metadata"].get("deletionTimestamp")
            and (launcher["metadata"].get("annotations") or {}).get(naming.SPEC_HASH) != desired
        ):
            return "launcher"
        live_workers = [pod for pod in workers if not pod["metadata"].get("deletionTimestamp")]
        if not live_workers:
            return None
        if all(
            (pod["metadata"].get("annotations") or {}).get(naming.SPEC_HASH) == wanted for pod in live_workers
        ):
            return None
        # Workers come from the StatefulSet's template: replacing them before the reconcile has
        # patched it would bring back the old spec (and replace the world a second time).
        sts = await self.kube.get(
            "apps/v1", "StatefulSet", owner.namespace, naming.world_name(owner.name, index)
        )
        template = ((sts or {}).get("spec") or {}).get("template") or {}
        if (template.get("metadata", {}).get("annotations") or {}).get(naming.SPEC_HASH) != wanted:
            return None
        return "worker"

    def _delete_pod(self, owner: render.Owner, spec: LLMDeploymentSpec, name: str) -> Awaitable[bool]:
        """Delete a pod of a world that drained already or has nothing to drain (dead, silent,
        released, parked): the engine gets its shutdown margin, not the launcher's grace period,
        which is the drain timeout plus that margin for the deletions the operator does not
        decide (an eviction, a drained node)."""
        grace = render.stop_grace_seconds(spec)
        return self.kube.delete("v1", "Pod", owner.namespace, name, grace_seconds=grace)

    async def _replace_world(
        self, owner: render.Owner, spec: LLMDeploymentSpec, index: int, doomed: list[str], now: dt.datetime
    ) -> None:
        """Delete the launcher and every worker pod together, then start a new launcher.

        The StatefulSet brings the workers back under the same names (stable host names, so
        the hostfile stays valid); the launcher is ours to recreate (once the old one is gone,
        and without a gang scheduler once the new workers have nodes).
        """
        for name in doomed:
            await self._write(index, f"Pod/{name}", "delete", now, self._delete_pod(owner, spec, name))
        world_name = naming.world_name(owner.name, index)
        if self.problems.immutable_statefulset(world_name):
            # Deleted (its pods go with it, background propagation) and created anew from the spec.
            deletion = self.kube.delete("apps/v1", "StatefulSet", owner.namespace, world_name)
            if await self._write(index, f"StatefulSet/{world_name}", "delete", now, deletion):
                outcome = reconcile.Outcome()
                sts = render.worker_statefulset(owner, spec, index)
                await reconcile.ensure(self.kube, sts, outcome, self.drift)
                self._expect(f"StatefulSet/{world_name}", "create")
                for event in outcome.events() + outcome.record_writes(self.problems, now):
                    self.post_event(*event)
        # Without a gang scheduler the next rounds create it, once the new workers have nodes.
        if spec.scheduling.gang != "none" and self._may_create_launcher(owner, index, now):
            await self._create_launcher(owner, spec, index, now)

    async def _release_world(
        self, owner: render.Owner, spec: LLMDeploymentSpec, index: int, release: bool, now: dt.datetime
    ) -> None:
        """Give back every pod of a world that could not be scheduled whole (its StatefulSet to 0,
        its launcher deleted), or bring the world back when its retry time has come."""
        outcome = reconcile.Outcome()
        sts = render.worker_statefulset(owner, spec, index, released=release)
        await reconcile.ensure(self.kube, sts, outcome, self.drift)
        for event in outcome.events() + outcome.record_writes(self.problems, now):
            self.post_event(*event)
        if release:
            name = naming.launcher_pod_name(owner.name, index)
            await self._write(index, f"Pod/{name}", "delete", now, self._delete_pod(owner, spec, name))

    async def _create_launcher(
        self, owner: render.Owner, spec: LLMDeploymentSpec, index: int, now: dt.datetime
    ) -> None:
        # Conflict: the old pod is still terminating (graceful deletion); the next round tries again.
        with contextlib.suppress(Conflict):
            ref = f"Pod/{naming.launcher_pod_name(owner.name, index)}"
            await self._write(
                index, ref, "create", now, self.kube.create(render.launcher_pod(owner, spec, index))
            )

    async def _write(self, index: int | None, ref: str, verb: str, now: dt.datetime, call: Any) -> bool:
        """One write of this loop's own; a refusal is recorded (status, an Event) and retried with
        backoff, and the round goes on with the other worlds."""
        try:
            await call
        except KubeError as exc:
            if exc.status not in reconcile.REFUSED:
                raise
            for event in self.problems.refused(RefusedWrite(ref, verb, exc.status, exc.message, index), now):
                self.post_event(*event)
            return False
        self.problems.succeeded(ref)
        self._expect(ref, verb)
        return True

    def _may_create_launcher(self, owner: render.Owner, index: int, now: dt.datetime) -> bool:
        """Not while the world is blocked by a conflict, while the launcher's last create backs
        off, or while a child it needs could not be created."""
        ref = f"Pod/{naming.launcher_pod_name(owner.name, index)}"
        needed = {
            f"ConfigMap/{naming.hostfile_name(owner.name, index)}",
            f"Service/{naming.world_name(owner.name, index)}",
            f"StatefulSet/{naming.world_name(owner.name, index)}",
        }
        missing = any(
            refusal.write.verb == "create" for key, refusal in self.problems.refusals.items() if key in needed
        )
        return not (self.problems.world_conflicts(index) or self.problems.waiting(ref, now) or missing)

    async def _children(self, api_version: str, kind: str, owner: render.Owner) -> list[dict[str, Any]]:
        """The deployment's objects of `kind` that carry its label: from the watches once they
        show this loop's own writes, else listed from the API server."""
        objects = self.children.of(kind, owner.namespace, owner.name) if self.children is not None else None
        if objects is None or not self._expected[kind].met_by(objects):
            objects = await self.kube.list(
                api_version, kind, owner.namespace, {naming.DEPLOYMENT: owner.name}
            )
        self._uids.update({(kind, obj["metadata"]["name"]): obj["metadata"]["uid"] for obj in objects})
        return objects

    def _seen(self, owner: render.Owner) -> Seen | None:
        """The watches' view of every child, for a reconcile: of pods and StatefulSets only once
        it shows this loop's own writes (they are read from the API server until then)."""
        if self.children is None:
            return None
        shown = {kind: self.children.of(kind, owner.namespace, owner.name) for kind in self.children.kinds}
        return Seen(
            {
                kind: objects
                for kind, objects in shown.items()
                if kind not in self._expected or self._expected[kind].met_by(objects)
            }
        )

    def _expect(self, ref: str, verb: str) -> None:
        """Remember a write of a pod or StatefulSet until the watches show it."""
        kind, _, name = ref.partition("/")
        if kind not in self._expected:
            return
        if verb == "create":
            self._expected[kind].created(name)
        elif verb == "delete" and (kind, name) in self._uids:
            self._expected[kind].deleted(self._uids[(kind, name)])

    async def _own_pods(self, owner: render.Owner) -> list[dict[str, Any]]:
        """The launcher and worker pods of this LLMDeployment: a launcher it controls, a worker its
        StatefulSet controls. A pod that only carries the labels is someone else's (and is never
        polled with the admin token, restarted or deleted)."""
        statefulsets = {
            sts["metadata"]["uid"]
            for sts in await self._children("apps/v1", "StatefulSet", owner)
            if controlled_by(sts, owner.uid)
        }
        own = []
        for pod in await self._children("v1", "Pod", owner):
            role = (pod["metadata"].get("labels") or {}).get(naming.ROLE)
            controller = controller_of(pod) or {}
            if (role == "launcher" and controller.get("uid") == owner.uid) or (
                role == "worker" and controller.get("uid") in statefulsets
            ):
                own.append(pod)
        return own

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
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        meta = body["metadata"]
        generation = meta.get("generation")
        new = {
            "worlds": world_statuses,
            "conditions": conditions.merge_conditions(previous.get("conditions"), conds, now, generation),
            "phase": phase,
            "readyReplicas": ready,
            "worldsReady": f"{ready}/{desired}",
            **(extra or {}),
        }
        if all(previous.get(key) == value for key, value in new.items()):
            return
        patch = {key: _with_deletions(previous.get(key), value) for key, value in new.items()}
        try:
            await self.kube.patch(
                API_VERSION, KIND, meta["namespace"], meta["name"], {"status": patch}, subresource="status"
            )
        except NotFound:
            raise OwnerGone(f"{meta['namespace']}/{meta['name']}") from None
        self._written = {**previous, **new}


def _with_deletions(previous: Any, new: Any) -> Any:
    """The merge-patch value that turns `previous` into `new`: a key of an object that `new`
    no longer has is sent as null (a JSON merge patch keeps every key it does not name, so a
    rollout's `complete` or `failed` would otherwise outlive it), in nested objects too."""
    if not isinstance(previous, Mapping) or not isinstance(new, Mapping):
        return new
    patch = {key: _with_deletions(previous.get(key), value) for key, value in new.items()}
    patch.update({key: None for key in previous if key not in new})
    return patch
