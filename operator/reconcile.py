"""Bring an LLMDeployment's children to the rendered state: create what is missing, patch what
drifted, delete what is no longer wanted. Idempotent: running it twice, or after an operator
restart, changes nothing the first run did not (names are deterministic, creates that race
with an existing object fall back to comparing it).

Ownership of the pods is split on purpose: this module creates a world's launcher pod when it
is missing, but never replaces a running one; replacing pods is a world restart, and world
restarts belong to the health daemon (worlds.py), which keeps the restart history.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from berth.operator import credentials, naming, render
from berth.operator.crd_model import LLMDeploymentSpec
from berth.operator.kube import Conflict, Kube, KubeError

# Kinds the operator creates per world, pruned when a world or the frontends go away.
# (Worker pods are the StatefulSets' own; launcher pods are pruned by their role label.)
PRUNABLE: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("v1", "ConfigMap", {}),
    ("v1", "Service", {}),
    ("apps/v1", "StatefulSet", {}),
    ("apps/v1", "Deployment", {}),
)


@dataclass
class Outcome:
    """What one reconcile did, as "Kind/name" strings (for Events and logs)."""

    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    # (ref, field): patched, but the server stores that field otherwise (it normalises it).
    unconverged: list[tuple[str, str]] = field(default_factory=list)

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
    """The part of a manifest the operator owns and patches back when it drifts."""
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


async def ensure(
    kube: Kube, desired: Mapping[str, Any], outcome: Outcome, drift: DriftMemory | None = None
) -> dict[str, Any]:
    """Create `desired`, or patch its managed fields back if they drifted. Returns the live object.

    Pods are created but never patched: their specs are immutable; an outdated launcher pod
    is the daemon's to replace (a world restart).
    """
    meta = desired["metadata"]
    live = await kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
    if live is None:
        try:
            created = await kube.create(desired)
            outcome.created.append(_ref(desired))
            return created
        except Conflict:
            # Someone (the daemon, a previous operator) created it between our read and write.
            live = await kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
            if live is None:
                raise
        except KubeError as exc:
            if exc.status != 422:
                raise
            # Refused as invalid: say which child (the stage creates several at once).
            raise KubeError(422, f"{_ref(desired)}: {exc.message}") from exc
    if desired["kind"] == "Pod":
        return live
    wanted = managed_fields(desired)
    key = (desired["kind"], meta["namespace"], meta["name"])
    drift = drift if drift is not None else DriftMemory()
    if is_subset(wanted, live):
        drift.forget(key)
        return live
    digest = drift.digest(wanted)
    if drift.is_stuck(key, digest, live.get("metadata", {}).get("resourceVersion")):
        return live  # the last identical patch changed nothing the server keeps
    patched = await kube.patch(
        desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"], wanted
    )
    # A patch that the server found to be a no-op (e.g. a quantity it normalises) keeps the
    # resourceVersion; only real changes are reported.
    if patched.get("metadata", {}).get("resourceVersion") != live.get("metadata", {}).get("resourceVersion"):
        outcome.patched.append(_ref(desired))
    if not is_subset(wanted, patched):
        # The server rewrote what it was sent: patching again would loop forever.
        drift.remember(key, digest, patched.get("metadata", {}).get("resourceVersion"))
        outcome.unconverged.append((_ref(desired), first_difference(wanted, patched)))
    return patched


async def ensure_secrets(kube: Kube, owner: render.Owner, outcome: Outcome) -> None:
    """Create each Secret once with fresh key material; an existing one keeps its data."""
    makers = (
        (
            naming.engine_key_secret(owner.name),
            lambda: render.engine_key_secret(owner, credentials.new_engine_key()),
        ),
        (
            naming.admin_token_secret(owner.name),
            lambda: render.admin_token_secret(owner, credentials.new_admin_token()),
        ),
        (
            naming.ssh_secret(owner.name),
            lambda: render.ssh_secret(owner, credentials.new_ssh_key_pair(owner.name)),
        ),
    )

    async def one(name: str, make: Any) -> None:
        live = await kube.get("v1", "Secret", owner.namespace, name)
        if live is None:
            # Generate only when missing: a reconcile must never rotate keys under a running world.
            await ensure(kube, make(), outcome)
        else:
            # Labels and owner references are still ours to keep right; the data is not touched.
            wanted = {"metadata": render.secret_metadata(owner, name)}
            if not is_subset(managed_fields({"kind": "Secret", **wanted}), live):
                await kube.patch(
                    "v1", "Secret", owner.namespace, name, managed_fields({"kind": "Secret", **wanted})
                )
                outcome.patched.append(f"Secret/{name}")

    # Independent of each other: concurrently (each is a read and maybe a write).
    await asyncio.gather(*(one(name, make) for name, make in makers))


def retiring_worlds(spec: LLMDeploymentSpec, launchers: list[dict[str, Any]]) -> set[int]:
    """Worlds beyond `replicas` whose launcher pod still stands: they drain before they go."""
    found = set()
    for pod in launchers:
        world = (pod["metadata"].get("labels") or {}).get(naming.WORLD, "")
        if world.isdigit() and int(world) >= spec.replicas and not pod["metadata"].get("deletionTimestamp"):
            found.add(int(world))
    return found


async def prune(kube: Kube, owner: render.Owner, spec: LLMDeploymentSpec, outcome: Outcome) -> None:
    """Delete the children of worlds beyond `replicas` and frontends no longer wanted.

    A world beyond `replicas` keeps everything while its launcher pod stands: the health
    daemon first drains its engine (sleep, mode drain) and deletes the launcher, so requests
    in flight there finish; the rest of the world goes on the next prune.
    """
    wanted = {_ref(child) for child in render.children(owner, spec)}
    selector = {naming.MANAGED_BY: "berth", naming.DEPLOYMENT: owner.name}
    launchers = {naming.ROLE: "launcher"}
    live_launchers = await kube.list("v1", "Pod", owner.namespace, {**selector, **launchers})
    draining = {str(world) for world in retiring_worlds(spec, live_launchers)}
    for api_version, kind, labels in (*PRUNABLE, ("v1", "Pod", launchers)):
        found = (
            live_launchers
            if kind == "Pod"
            else await kube.list(api_version, kind, owner.namespace, {**selector, **labels})
        )
        for live in found:
            # List items carry no kind on a real API server: name them from the query.
            ref = f"{kind}/{live['metadata']['name']}"
            unwanted = ref not in wanted and _owned_by(live, owner)
            if (live["metadata"].get("labels") or {}).get(naming.WORLD) in draining:
                continue
            if unwanted and await kube.delete(api_version, kind, owner.namespace, live["metadata"]["name"]):
                outcome.deleted.append(ref)


def _owned_by(obj: Mapping[str, Any], owner: render.Owner) -> bool:
    return any(ref.get("uid") == owner.uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


async def reconcile(
    kube: Kube,
    owner: render.Owner,
    spec: LLMDeploymentSpec,
    *,
    prune_extra: bool,
    drift: DriftMemory | None = None,
) -> Outcome:
    """Secrets first (pods reference them), then every world's hostfile, headless Service and
    StatefulSet and the endpoint, then the launcher pods and frontends (their hostfile and
    Service exist before mpirun looks for them).

    Within a stage the objects are independent, so they go concurrently: the reconcile's
    latency is three stages of API round trips, not two round trips per child (14 children per
    2-world deployment took 26 sequential round trips)."""
    outcome = Outcome()
    await ensure_secrets(kube, owner, outcome)
    children = render.children(owner, spec)
    for stage in (
        [child for child in children if child["kind"] not in ("Pod", "Deployment")],
        [child for child in children if child["kind"] in ("Pod", "Deployment")],
    ):
        await asyncio.gather(*(ensure(kube, child, outcome, drift) for child in stage))
    if prune_extra:
        await prune(kube, owner, spec, outcome)
    return outcome
