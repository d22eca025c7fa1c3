"""kopf handlers: thin, declarative wiring of the operator's modules to LLMDeployment events.

- create / spec update / operator resume → reconcile.py (children to the rendered state)
- one daemon per LLMDeployment → supervisor.py (health polls, world restarts, status)
Importing this module registers the handlers in kopf's default registry.

No finalizer: deleting an LLMDeployment never waits for the operator (an uninstalled or stopped
operator leaves nothing that hangs). Its children go with it by their owner references (the
garbage collector, not the operator, deletes them), and its daemon stops when the deletion is
seen (a watch event) or, if that event was missed, when its status can no longer be written.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any

import httpx
import kopf

from berth.operator import autoscale, gang, health, naming, reconcile, render, watched
from berth.operator.child_problems import ChildProblems
from berth.operator.crd_model import GROUP, PLURAL, VERSION, InvalidSpec, parse_spec
from berth.operator.kube import Kube, KubeError
from berth.operator.metrics import metrics
from berth.operator.supervisor import OwnerGone, Supervisor, utc_now

# The finalizer operators before this one put on every LLMDeployment. kopf still knows its name:
# it removes it from an object that has it, as no handler needs it (an upgrade unblocks them).
FINALIZER = "berth.dev/operator"
RETRY_DELAY = 5.0
# How often the daemon re-runs the full reconcile, repairing children changed or deleted
# behind the operator's back (handlers only fire on the LLMDeployment's own changes).
RESYNC_SECONDS = 60.0
# Watches end after this long and are opened again (the server closes them, or the client
# gives up on one that stalls): a watch that silently stopped delivering cannot last.
WATCH_SERVER_TIMEOUT = 300
WATCH_CLIENT_TIMEOUT = 330


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    # kopf's bookkeeping lives in status, not in annotations: the operator then writes only
    # status (and its finalizer), so an Argo CD-synced LLMDeployment never drifts from Git.
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(
        field="status.kopf.lastHandledConfiguration"
    )
    # No watch of CustomResourceDefinitions or Namespaces (cluster-scoped: they would need a
    # ClusterRole in the namespaced install): the CRD ships with the operator and is found by
    # discovery at start; namespaces are given by name (--namespace) or all of them.
    settings.scanning.disabled = True
    settings.watching.server_timeout = settings.watching.server_timeout or WATCH_SERVER_TIMEOUT
    settings.watching.client_timeout = settings.watching.client_timeout or WATCH_CLIENT_TIMEOUT
    settings.posting.reporting_component = "berth-operator"
    settings.posting.event_name_prefix = "berth-"
    memo.kube = await Kube.connect(memo.get("kubeconfig"))
    memo.drift = reconcile.DriftMemory()
    # kopf runs only while this replica holds the Lease (operator/process.py): it acts, and a
    # standby's /metrics says 0 (alerts page when no replica leads).
    metrics().leader.set(1)
    memo.http = httpx.AsyncClient()
    # The one replaceable function that turns a launcher pod into an address to poll.
    memo.setdefault("resolve_launcher_address", health.pod_address)
    logger.info("berth operator configured")


@kopf.on.cleanup()
async def close_clients(memo: kopf.Memo, **_: Any) -> None:
    metrics().leader.set(0)
    if "http" in memo:
        await memo.http.aclose()
    if "kube" in memo:
        await memo.kube.close()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # Explicit, and read at call time: kopf's default piggybacks on a client whose kubeconfig
    # path was frozen when it was imported.
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return kopf.login_with_service_account(**kwargs)
    return kopf.login_with_kubeconfig(**kwargs)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def reconcile_children(
    body: kopf.Body,
    spec: kopf.Spec,
    name: str,
    namespace: str,
    uid: str,
    meta: kopf.Meta,
    reason: kopf.Reason,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **indexes: Any,
) -> None:
    started = time.perf_counter()
    children = _watched_children(memo, indexes)
    generation = meta.get("generation")
    try:
        parsed = parse_spec(spec, name)
    except InvalidSpec as exc:
        metrics().reconciles.labels("invalid").inc()
        kopf.warn(body, reason="InvalidSpec", message=str(exc))
        # The refusal is this generation's answer: observedGeneration says it was seen (Argo CD
        # shows Degraded, not Progressing forever). kopf applies the patch of a failed handler too.
        _refuse(patch, generation, str(exc))
        raise kopf.PermanentError(f"invalid spec: {exc}") from None

    owner = render.Owner(name=name, namespace=namespace, uid=uid)
    # With autoscaling the worlds are the count it decided last (status), not spec.replicas.
    parsed = autoscale.effective_spec(parsed, body.get("status"))
    try:
        # A fresh object has nothing to prune; updates and resumes may (scale down, frontends 0).
        outcome = await reconcile.reconcile(
            memo.kube,
            owner,
            parsed,
            prune_extra=reason != kopf.Reason.CREATE,
            drift=memo.drift,
            released=gang.released_worlds((body.get("status") or {}).get("worlds") or [], utc_now()),
            seen=children.seen(namespace, name) if children is not None else None,
        )
    except KubeError as exc:
        # Refusals (403, 422) and conflicts are in the outcome; this is the API being unwell.
        metrics().reconciles.labels("retry").inc()
        raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=RETRY_DELAY) from exc

    # Conflicting objects and refused writes go to the health daemon, which shows them in status
    # and retries the refused writes with backoff while it supervises the other worlds.
    problem_events = outcome.record(_child_problems(memo), utc_now())
    for type_, event_reason, message in outcome.events() + problem_events:
        kopf.event(body, type=type_, reason=event_reason, message=message)
    patch.status["observedGeneration"] = generation
    patch.status["refusal"] = None
    patch.status["replicas"] = parsed.replicas
    patch.status["selector"] = naming.launcher_selector(name)
    patch.status["endpoint"] = naming.endpoint_url(name, namespace, parsed.service.port)
    metrics().reconciles.labels("success").inc()
    metrics().reconcile_seconds.observe(time.perf_counter() - started)
    # The health daemon acts on the new spec now (a sleep switch, schedules, replicas), not a
    # poll later. kopf's memo is per object: this is this LLMDeployment's daemon.
    _spec_changed(memo).set()
    if outcome.changed:
        logger.info(
            f"reconciled: {len(outcome.created)} created, {len(outcome.patched)} patched, "
            f"{len(outcome.deleted)} deleted"
        )


def _child_problems(memo: kopf.Memo) -> ChildProblems:
    if "child_problems" not in memo:
        memo.child_problems = ChildProblems()
    return memo.child_problems


def _gone(memo: kopf.Memo) -> asyncio.Event:
    if "gone" not in memo:
        memo.gone = asyncio.Event()
    return memo.gone


def _is_deletion(type: str | None, **_: Any) -> bool:
    return type == "DELETED"


# Filtered to deletions: kopf logs every call of an event handler, and the other events (every
# status write) would fill the log.
@kopf.on.event(GROUP, VERSION, PLURAL, when=_is_deletion)
def notice_deletion(memo: kopf.Memo, **_: Any) -> None:
    # Without a finalizer kopf never sees a deletion coming: the watch's DELETED event is the
    # daemon's only word that its object is gone. kopf's memo is per object: this one's daemon.
    _gone(memo).set()
    _spec_changed(memo).set()  # wakes the daemon's pause


def _spec_changed(memo: kopf.Memo) -> asyncio.Event:
    if "spec_changed" not in memo:
        memo.spec_changed = asyncio.Event()
    return memo.spec_changed


async def _pause(stopped: kopf.DaemonStopped, wake: asyncio.Event, seconds: float) -> None:
    """Until `seconds` pass, the daemon is stopped, or `wake` is set (the spec changed, or a
    transition ended), whichever is first."""
    waits = {asyncio.ensure_future(stopped.wait(seconds)), asyncio.ensure_future(wake.wait())}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
    wake.clear()


def _refuse(patch: kopf.Patch, generation: int | None, message: str) -> None:
    """Record a refused spec where the health daemon reads it (it reports Degraded/InvalidSpec)."""
    patch.status["observedGeneration"] = generation
    patch.status["refusal"] = {"generation": generation, "message": message}


# Every berth-labelled child of the watched kinds, as the watches last saw it (watched.py): the
# health rounds and resyncs read them here instead of from the API server. kind -> (resource, index
# name: the keyword the handlers receive it by).
WATCHED = {
    "Pod": (("v1", "pods"), "berth_pods"),
    "StatefulSet": (("apps", "v1", "statefulsets"), "berth_statefulsets"),
    "ConfigMap": (("v1", "configmaps"), "berth_configmaps"),
    "Service": (("v1", "services"), "berth_services"),
    "Deployment": (("apps", "v1", "deployments"), "berth_deployments"),
    "NetworkPolicy": (("networking.k8s.io", "v1", "networkpolicies"), "berth_networkpolicies"),
    "PodDisruptionBudget": (("policy", "v1", "poddisruptionbudgets"), "berth_poddisruptionbudgets"),
}


def berth_child(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict:
    return watched.entry(body, namespace, labels[naming.DEPLOYMENT])


for _resource, _index in WATCHED.values():
    kopf.index(*_resource, id=_index, labels={naming.DEPLOYMENT: kopf.PRESENT})(berth_child)


def _watched_children(memo: kopf.Memo, indexes: dict[str, Any]) -> watched.WatchedChildren | None:
    """The watches' view of the children, from the indexes kopf hands every handler; None where
    the operator reads the API server instead (memo.list_children: the benchmark's baseline)."""
    if memo.get("list_children"):
        return None
    return watched.WatchedChildren({kind: indexes[index] for kind, (_, index) in WATCHED.items()})


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5.0)
async def supervise_worlds(
    body: kopf.Body,
    name: str,
    namespace: str,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **indexes: Any,
) -> None:
    children = _watched_children(memo, indexes)
    supervisor = Supervisor(
        kube=memo.kube,
        http=memo.http,
        resolver=memo.resolve_launcher_address,
        metrics=metrics(),
        post_event=lambda type_, reason, message: kopf.event(
            body, type=type_, reason=reason, message=message
        ),
        logger=logger,
        resync_seconds=float(memo.get("resync_seconds", RESYNC_SECONDS)),
        drift=memo.drift,
        # Replaceable (tests run the schedules on a shifted clock); real time otherwise.
        clock=memo.get("clock") or utc_now,
        wake=_spec_changed(memo).set,
        problems=_child_problems(memo),
        children=children,
    )
    wake, gone = _spec_changed(memo), _gone(memo)
    try:
        while not stopped and not gone.is_set():
            try:
                interval = await supervisor.tick(body)
            except OwnerGone:
                break  # deleted while the watch was away: nothing left to supervise
            except KubeError as exc:
                logger.warning(f"health round failed, retrying: {exc}")
                interval = RETRY_DELAY
            await _pause(stopped, wake, interval)
    finally:
        supervisor.close()
        metrics().forget(namespace, name)


def _without_finalizer(daemon: Any) -> None:
    """Spawn `daemon` without putting kopf's finalizer on its objects.

    kopf's daemons always ask for one, so that an object's deletion waits until its daemon has
    stopped. Here nothing needs that wait (the children are the garbage collector's, the daemon
    stops on the deletion event, `notice_deletion`), and the wait hangs every deletion, and the
    CRD's with them, once the operator is gone. kopf has no public switch for it: its handler
    record is replaced by one that does not require the finalizer
    (tests/operator/test_operator_uninstall.py deletes an LLMDeployment with the operator stopped).
    """
    spawning = kopf.get_default_registry()._spawning
    found = [handler for handler in spawning._handlers if handler.fn is daemon]
    if not found:
        raise RuntimeError(f"{daemon.__name__} is not a registered kopf daemon")
    spawning._handlers[:] = [
        dataclasses.replace(handler, requires_finalizer=False) if handler.fn is daemon else handler
        for handler in spawning._handlers
    ]


_without_finalizer(supervise_worlds)
