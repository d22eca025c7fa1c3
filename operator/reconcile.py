"""Bring an LLMDeployment's children to the rendered state: create what is missing, patch what
drifted, delete what is no longer wanted. Idempotent: running it twice, or after an operator
restart, changes nothing the first run did not (names are deterministic, creates that race
with an existing object fall back to comparing it).

Never adopt: an object with a child's name that this LLMDeployment does not control is left
exactly as it is and reported (child_problems.py); so is a write the API server refuses (403,
422), which a later round retries. Neither stops the rest of the deployment: a world whose own
objects are in the way waits, the other worlds are built.

Ownership of the pods is split on purpose: this module creates a world's launcher pod when it
is missing, but never replaces a running one; replacing pods is a world restart, and world
restarts belong to the health daemon (worlds.py), which keeps the restart history.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from berth.operator import credentials, naming, render
from berth.operator.child_problems import (
    ChildProblems,
    ConflictingObject,
    RefusedWrite,
    controlled_by,
    describe_controller,
)
from berth.operator.crd_model import LLMDeploymentSpec
from berth.operator.kube import Conflict, Kube, KubeError
from berth.operator.watched import Seen

# What an API server answers a write it refuses for good until someone changes something:
# forbidden (admission, quota, a webhook, RBAC) and invalid. Reported and retried, not fatal.
REFUSED = (403, 422)

# Kinds the operator creates per world, pruned when a world or the frontends go away.
# (Worker pods are the StatefulSets' own; launcher pods are pruned by their role label.)
PRUNABLE: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("v1", "ConfigMap", {}),
    ("v1", "Service", {}),
    ("apps/v1", "StatefulSet", {}),
    ("apps/v1", "Deployment", {}),
    ("networking.k8s.io/v1", "NetworkPolicy", {}),
    ("policy/v1", "PodDisruptionBudget", {}),
)


@dataclass
class Outcome:
    """What one reconcile did, as "Kind/name" strings (for Events and logs)."""

    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    # (ref, field): patched, but the server stores that field otherwise (it normalises it).
    unconverged: list[tuple[str, str]] = field(default_factory=list)
    conflicts: list[ConflictingObject] = field(default_factory=list)  # never adopted
    refused: list[RefusedWrite] = field(default_factory=list)  # 403 / 422, retried later
    succeeded: list[str] = field(default_factory=list)  # refs written (or current) this time

    def record(self, problems: ChildProblems, now: dt.datetime) -> list[tuple[str, str, str]]:
        """What a full reconcile found, into the deployment's memory of problems; returns the
        Events for the new ones."""
        return problems.set_conflicts(self.conflicts) + self.record_writes(problems, now)

    def record_writes(self, problems: ChildProblems, now: dt.datetime) -> list[tuple[str, str, str]]:
        """The writes of a partial reconcile (some children only): refusals and successes."""
        events = []
        for ref in self.succeeded:
            problems.succeeded(ref)
        for write in self.refused:
            events += problems.refused(write, now)
        return events

    @property
    def changed(self) -> bool:
        return bool(self.created or self.patched or self.deleted)

    def events(self) -> list[tuple[str, str, str]]:
        """(type, reason, message) of one Kubernetes Event per change."""
        return (
            [("Normal", "Created", f"created {ref}") for ref in self.created]
            + [("Normal", "Updated", f"patched {ref} back to the desired state") for ref in self.patched]
            + [("Normal", "Deleted", f"deleted {ref}: no longer wanted") for ref in self.deleted]
            + [
                (
                    "Warning",
                    "PatchNotConverging",
                    f"patched {ref}, but the API server stores {where} differently from what the operator "
                    "renders; not patching it again until the LLMDeployment or the object changes",
                )
                for ref, where in self.unconverged
            ]
        )


@dataclass
class DriftMemory:
    """Patches the API server did not take as sent (it rewrote a value the renderer did not
    render in the server's own form). Remembered per object with the rendering and the
    resourceVersion the patch left, so the same futile patch is not sent on every resync; a new
    rendering or a change to the object (someone else's write) makes it worth trying again."""

    _stuck: dict[tuple[str, str, str], tuple[str, str]] = field(default_factory=dict)

    @staticmethod
    def digest(wanted: Mapping[str, Any]) -> str:
        """A digest of a rendering (stable: keys sorted)."""
        return hashlib.sha256(json.dumps(wanted, sort_keys=True, default=str).encode()).hexdigest()

    def is_stuck(self, key: tuple[str, str, str], digest: str, resource_version: str | None) -> bool:
        return self._stuck.get(key) == (digest, resource_version)

    def remember(self, key: tuple[str, str, str], digest: str, resource_version: str | None) -> None:
        self._stuck[key] = (digest, str(resource_version))

    def forget(self, key: tuple[str, str, str]) -> None:
        self._stuck.pop(key, None)


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of `desired` has the same value in `live`.

    The API server adds defaults (a container's terminationMessagePath, a Service's clusterIP)
    that the operator never asked for; those must not count as drift. Lists compare element
    by element and must have the same length.
    """
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(
            key in live and is_subset(value, live[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, v) for d, v in zip(desired, live))
        )
    if (isinstance(desired, (int, float)) and isinstance(live, str)) or (
        isinstance(desired, str) and isinstance(live, (int, float))
    ):
        return str(desired) == str(live)
    return desired == live


def first_difference(desired: Any, live: Any, path: str = "") -> str:
    """The path of the first field where `live` is not what `desired` asks (for messages)."""
    if isinstance(desired, Mapping) and isinstance(live, Mapping):
        for key, value in desired.items():
            if key not in live or not is_subset(value, live[key]):
                return first_difference(value, live.get(key), f"{path}.{key}" if path else str(key))
    if isinstance(desired, list) and isinstance(live, list) and len(desired) == len(live):
        for index, (d, v) in enumerate(zip(desired, live)):
            if not is_subset(d, v):
                return first_difference(d, v, f"{path}[{index}]")
    return path or "<root>"


def managed_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a manifest the operator owns and applies back when it drifts."""
    meta = obj["metadata"]
    managed: dict[str, Any] = {
        "metadata": {key: meta[key] for key in ("labels", "annotations", "ownerReferences") if key in meta}
    }
    for key, value in obj.items():
        # Secrets' data is generated once and never rewritten (running worlds hold the keys).
        if key not in ("apiVersion", "kind", "metadata", "status") and obj["kind"] != "Secret":
            managed[key] = value
    return managed


def _ref(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _world(obj: Mapping[str, Any]) -> int | None:
    world = (obj["metadata"].get("labels") or {}).get(naming.WORLD, "")
    return int(world) if world.isdigit() else None


def _owner_uid(desired: Mapping[str, Any]) -> str:
    return desired["metadata"]["ownerReferences"][0]["uid"]


def _conflict(live: Mapping[str, Any], desired: Mapping[str, Any]) -> ConflictingObject:
    return ConflictingObject(
        desired["kind"], desired["metadata"]["name"], describe_controller(live), _world(desired)
    )


def applied_config(desired: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator applies: the rendering, marked with its own digest. The digest says
    whether the object holds this rendering: a field the rendering no longer has (a nodeSelector
    the user removed) leaves the live object a superset of it, which no comparison of fields
    shows, and only an apply removes it."""
    config = copy.deepcopy(dict(desired))
    # A Secret's data is generated once, not applied: its metadata is the rendering.
    digest = DriftMemory.digest(_identity(config) if config["kind"] == "Secret" else config)[:16]
    config["metadata"].setdefault("annotations", {})[naming.APPLIED] = digest
    return config


async def ensure(
    kube: Kube,
    desired: Mapping[str, Any],
    outcome: Outcome,
    drift: DriftMemory | None = None,
    seen: Seen | None = None,
) -> dict[str, Any] | None:
    """Create `desired`, or apply it again if the object drifted or the rendering changed.
    Returns the live object, or None when it is not this LLMDeployment's (a conflict) or the API
    server refused the write (both recorded in `outcome`).

    Written with server-side apply (field manager berth-operator): a field the rendering no
    longer has is removed from the child, fields other managers set are left alone. Pods and
    Secrets are created, not applied: a pod's spec is immutable (an outdated launcher pod is the
    daemon's to replace, a world restart), and a Secret's data is generated once, so it must not
    be a field the operator applies (a later apply of its metadata alone would remove it).

    `seen`: the watches' view; an object it shows is not read again (at worst it is a little
    stale and applied once more). One it does not show is read: it may be there all the same.
    """
    meta = desired["metadata"]
    try:
        live = await _read(kube, desired, seen)
        if live is None:
            try:
                # An apply of an object that does not exist creates it. (One created by someone
                # else between the read above and this write would be taken over: the API has
                # no create-only apply; the window is one round trip.)
                if desired["kind"] == "Pod":
                    created = await kube.create(desired)
                elif desired["kind"] == "Secret":
                    created = await kube.create(applied_config(desired))
                else:
                    created = await kube.apply(applied_config(desired))
                outcome.created.append(_ref(desired))
                outcome.succeeded.append(_ref(desired))
                return created
            except Conflict:
                # Someone (the daemon, a previous operator, a user) created it between our read
                # and our write: whose it is decides below.
                live = await kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
                if live is None:
                    raise
    except KubeError as exc:
        return _refused(exc, "create", desired, outcome)
    return await keep(kube, desired, live, outcome, drift)


async def keep(
    kube: Kube,
    desired: Mapping[str, Any],
    live: dict[str, Any],
    outcome: Outcome,
    drift: DriftMemory | None = None,
) -> dict[str, Any] | None:
    """`ensure` for an object that exists: applied again if it is this LLMDeployment's, else a
    conflict, left exactly as it is."""
    if not controlled_by(live, _owner_uid(desired)):
        outcome.conflicts.append(_conflict(live, desired))
        return None
    try:
        result = live if desired["kind"] == "Pod" else await _apply_drift(kube, desired, live, outcome, drift)
    except KubeError as exc:
        return _refused(exc, "apply", desired, outcome)
    outcome.succeeded.append(_ref(desired))
    return result


async def _read(kube: Kube, desired: Mapping[str, Any], seen: Seen | None) -> dict[str, Any] | None:
    """The live object of `desired`: from the watches if they show it, else from the API server."""
    meta = desired["metadata"]
    live = seen.named(desired["kind"], meta["name"]) if seen is not None else None
    if live is None:
        live = await kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
    return live


async def _existing(
    kube: Kube, desired: Mapping[str, Any], outcome: Outcome, seen: Seen | None = None
) -> None:
    """`ensure` without the create: an object in the way is still found and reported."""
    try:
        live = await _read(kube, desired, seen)
    except KubeError as exc:
        _refused(exc, "get", desired, outcome)
        return
    if live is not None:
        await keep(kube, desired, live, outcome)


def _refused(exc: KubeError, verb: str, desired: Mapping[str, Any], outcome: Outcome) -> None:
    if exc.status not in REFUSED:
        raise exc
    outcome.refused.append(RefusedWrite(_ref(desired), verb, exc.status, exc.message, _world(desired)))


async def _apply_drift(
    kube: Kube,
    desired: Mapping[str, Any],
    live: dict[str, Any],
    outcome: Outcome,
    drift: DriftMemory | None,
) -> dict[str, Any]:
    meta = desired["metadata"]
    config = applied_config(desired)
    wanted = managed_fields(config)
    key = (desired["kind"], meta["namespace"], meta["name"])
    drift = drift if drift is not None else DriftMemory()
    if is_subset(wanted, live):
        drift.forget(key)
        return live
    digest = drift.digest(wanted)
    if drift.is_stuck(key, digest, live.get("metadata", {}).get("resourceVersion")):
        return live  # the last identical apply changed nothing the server keeps
    # A Secret's metadata only: its data is not a field the operator applies.
    applied = await kube.apply(_identity(config) if desired["kind"] == "Secret" else config)
    # An apply that the server found to be a no-op (e.g. a quantity it normalises) keeps the
    # resourceVersion; only real changes are reported.
    if applied.get("metadata", {}).get("resourceVersion") != live.get("metadata", {}).get("resourceVersion"):
        outcome.patched.append(_ref(desired))
    if not is_subset(wanted, applied):
        # The server rewrote what it was sent: applying again would loop forever.
        drift.remember(key, digest, applied.get("metadata", {}).get("resourceVersion"))
        outcome.unconverged.append((_ref(desired), first_difference(wanted, applied)))
    return applied


def _identity(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object without its content: what the operator applies of a Secret."""
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": obj["metadata"]}


async def ensure_secrets(kube: Kube, owner: render.Owner, outcome: Outcome) -> bool:
    """Create each Secret once with fresh key material; one this LLMDeployment controls keeps its
    data (a reconcile must never rotate keys under a running world), one it does not control is
    a conflict and never read. True when all three are usable."""
    makers = (
        lambda: render.engine_key_secret(owner, credentials.new_engine_key()),
        lambda: render.admin_token_secret(owner, credentials.new_admin_token()),
        lambda: render.ssh_secret(owner, credentials.new_ssh_key_pair(owner.name)),
    )

    async def one(make: Any) -> bool:
        desired = make()
        name = desired["metadata"]["name"]
        try:
            live = await kube.get("v1", "Secret", owner.namespace, name)
        except KubeError as exc:
            if exc.status not in REFUSED:
                raise
            outcome.refused.append(RefusedWrite(f"Secret/{name}", "get", exc.status, exc.message, None))
            return False
        if live is None:
            # Generated only when missing (ensure creates it, or finds whose it is after a race).
            return await ensure(kube, desired, outcome) is not None
        # Labels and owner references are still ours to keep right (if it is ours); the data is
        # never touched: the new key material above is thrown away.
        metadata_only = {key: value for key, value in desired.items() if key != "data"}
        return await keep(kube, metadata_only, live, outcome) is not None

    # Independent of each other: concurrently (each is a read and maybe a write).
    return all(await asyncio.gather(*(one(make) for make in makers)))


def retiring_worlds(spec: LLMDeploymentSpec, launchers: list[dict[str, Any]]) -> set[int]:
    """Worlds beyond `replicas` whose launcher pod still stands: they drain before they go."""
    found = set()
    for pod in launchers:
        world = (pod["metadata"].get("labels") or {}).get(naming.WORLD, "")
        if world.isdigit() and int(world) >= spec.replicas and not pod["metadata"].get("deletionTimestamp"):
            found.add(int(world))
    return found


async def prune(
    kube: Kube,
    owner: render.Owner,
    spec: LLMDeploymentSpec,
    outcome: Outcome,
    released: frozenset[int] = frozenset(),
    seen: Seen | None = None,
) -> None:
    """Delete the children of worlds beyond `replicas` and frontends no longer wanted.

    A world beyond `replicas` keeps everything while its launcher pod stands: the health
    daemon first drains its engine (sleep, mode drain) and deletes the launcher, so requests
    in flight there finish; the rest of the world goes on the next prune.

    `seen`: the watches' view, for the kinds it covers (listed from the API server otherwise).
    What it does not show yet is pruned on a later round; what it still shows after it went
    is deleted once more (a 404, nothing done).
    """
    wanted = {_ref(child) for child in render.children(owner, spec, released)}
    selector = {naming.MANAGED_BY: "berth", naming.DEPLOYMENT: owner.name}
    launchers = {naming.ROLE: "launcher"}

    async def found(api_version: str, kind: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        if seen is not None and seen.covers(kind):
            return seen.labelled(kind, {**selector, **labels})
        return await kube.list(api_version, kind, owner.namespace, {**selector, **labels})

    live_launchers = [pod for pod in await found("v1", "Pod", launchers) if controlled_by(pod, owner.uid)]
    draining = {str(world) for world in retiring_worlds(spec, live_launchers)}
    for api_version, kind, labels in (*PRUNABLE, ("v1", "Pod", launchers)):
        for live in live_launchers if kind == "Pod" else await found(api_version, kind, labels):
            # List items carry no kind on a real API server: name them from the query.
            ref = f"{kind}/{live['metadata']['name']}"
            # Only what this LLMDeployment controls: labels alone are anyone's to set.
            unwanted = ref not in wanted and controlled_by(live, owner.uid)
            if (live["metadata"].get("labels") or {}).get(naming.WORLD) in draining:
                continue
            if unwanted:
                try:
                    # A launcher pruned here has nothing to drain (its world drained or was released).
                    grace = render.stop_grace_seconds(spec) if kind == "Pod" else None
                    # Only the object seen: under its name there may be another since (the
                    # watches lag), and that one was not judged.
                    meta = live["metadata"]
                    if await kube.delete(
                        api_version, kind, owner.namespace, meta["name"], grace, meta.get("uid")
                    ):
                        outcome.deleted.append(ref)
                        outcome.succeeded.append(ref)
                except KubeError as exc:
                    if exc.status not in REFUSED:
                        raise
                    outcome.refused.append(RefusedWrite(ref, "delete", exc.status, exc.message, _world(live)))


async def reconcile(
    kube: Kube,
    owner: render.Owner,
    spec: LLMDeploymentSpec,
    *,
    prune_extra: bool,
    drift: DriftMemory | None = None,
    released: frozenset[int] = frozenset(),
    seen: Seen | None = None,
) -> Outcome:
    """Secrets first (pods reference them), then every world's hostfile, headless Service and
    StatefulSet and the endpoint, then the launcher pods and frontends (their hostfile and
    Service exist before mpirun looks for them).

    Within a stage the objects are independent, so they go concurrently: the reconcile's
    latency is three stages of API round trips, not two round trips per child (14 children per
    2-world deployment took 26 sequential round trips).

    `seen`: the children as the watches show them (watched.py); those it shows are not read
    from the API server again, and prune lists nothing it covers."""
    outcome = Outcome()
    secrets_usable = await ensure_secrets(kube, owner, outcome)
    children = render.children(owner, spec, released)  # released: worlds without pods (gang.py)
    # Every pod mounts the Secrets: none is made from a Secret that is not this deployment's.
    mounts_secrets = ("StatefulSet", "Pod", "Deployment")
    first = [
        child
        for child in children
        if child["kind"] not in ("Pod", "Deployment")
        and (secrets_usable or child["kind"] not in mounts_secrets)
    ]
    await asyncio.gather(*(ensure(kube, child, outcome, drift, seen) for child in first))
    # A world whose hostfile, Service or StatefulSet is someone else's, or was refused, gets no
    # launcher: mpirun would look for what is not there (or not ours).
    held_up = {conflict.world for conflict in outcome.conflicts} | {
        refused.world for refused in outcome.refused if refused.verb == "create"
    }
    # Without a gang scheduler a launcher waits for its workers' nodes: the health loop creates
    # it then (gang.launcher_may_start), so its startup budget is not spent on scheduling.
    launchers_later = spec.scheduling.gang == "none"
    second = [
        child
        for child in children
        if child["kind"] in ("Pod", "Deployment") and secrets_usable and _world(child) not in held_up
    ]
    await asyncio.gather(
        *(
            _existing(kube, child, outcome, seen)
            if child["kind"] == "Pod" and launchers_later
            else ensure(kube, child, outcome, drift, seen)
            for child in second
        )
    )
    if prune_extra:
        await prune(kube, owner, spec, outcome, released, seen)
    return outcome
