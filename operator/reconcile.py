"""Bring an LLMDeployment's children to the rendered state: create what is missing, patch what
drifted, delete what is no longer wanted. Idempotent: running it twice, or after an operator
restart, changes nothing the first run did not (names are deterministic, creates that race
with an existing object fall back to comparing it).

Ownership of the pods is split on purpose: this module creates a world's launcher pod when it
is missing, but never replaces a running one; replacing pods is a world restart, and world
restarts belong to the health daemon (worlds.py), which keeps the restart history.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from berth.operator import credentials, naming, render
from berth.operator.crd_model import LLMDeploymentSpec
from berth.operator.kube import Conflict, Kube

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

    @property
    def changed(self) -> bool:
        return bool(self.created or self.patched or self.deleted)

    def events(self) -> list[tuple[str, str, str]]:
        """(type, reason, message) of one Kubernetes Event per change."""
        return (
            [("Normal", "Created", f"created {ref}") for ref in self.created]
            + [("Normal", "Updated", f"patched {ref} back to the desired state") for ref in self.patched]
            + [("Normal", "Deleted", f"deleted {ref}: no longer wanted") for ref in self.deleted]
        )


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


async def ensure(kube: Kube, desired: Mapping[str, Any], outcome: Outcome) -> dict[str, Any]:
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
    if desired["kind"] == "Pod":
        return live
    wanted = managed_fields(desired)
    if is_subset(wanted, live):
        return live
    patched = await kube.patch(
        desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"], wanted
    )
    # A patch that the server found to be a no-op (e.g. a quantity it normalises) keeps the
    # resourceVersion; only real changes are reported.
    if patched.get("metadata", {}).get("resourceVersion") != live.get("metadata", {}).get("resourceVersion"):
        outcome.patched.append(_ref(desired))
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
    for name, make in makers:
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


async def prune(kube: Kube, owner: render.Owner, spec: LLMDeploymentSpec, outcome: Outcome) -> None:
    """Delete the children of worlds beyond `replicas` and frontends no longer wanted.

    (Scaling down here is immediate; draining a world before removing it belongs to rollouts.)
    """
    wanted = {_ref(child) for child in render.children(owner, spec)}
    selector = {naming.MANAGED_BY: "berth", naming.DEPLOYMENT: owner.name}
    launchers = {naming.ROLE: "launcher"}
    for api_version, kind, labels in (*PRUNABLE, ("v1", "Pod", launchers)):
        for live in await kube.list(api_version, kind, owner.namespace, {**selector, **labels}):
            # List items carry no kind on a real API server: name them from the query.
            ref = f"{kind}/{live['metadata']['name']}"
            unwanted = ref not in wanted and _owned_by(live, owner)
            if unwanted and await kube.delete(api_version, kind, owner.namespace, live["metadata"]["name"]):
                outcome.deleted.append(ref)


def _owned_by(obj: Mapping[str, Any], owner: render.Owner) -> bool:
    return any(ref.get("uid") == owner.uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


async def reconcile(
    kube: Kube, owner: render.Owner, spec: LLMDeploymentSpec, *, prune_extra: bool
) -> Outcome:
    """Secrets first (pods reference them), then each world in order, then the endpoint."""
    outcome = Outcome()
    await ensure_secrets(kube, owner, outcome)
    for child in render.children(owner, spec):
        await ensure(kube, child, outcome)
    if prune_extra:
        await prune(kube, owner, spec, outcome)
    return outcome
