"""Whether every pod that mounts the model volume can mount it at the same time.

The launcher and every worker pod of every world mount `spec.model.volume`, on whatever nodes
they are scheduled (a launcher needs no GPU node, so it rarely shares one with its workers). A
PersistentVolumeClaim that only one node may mount (`ReadWriteOnce`) or only one pod
(`ReadWriteOncePod`) leaves the pods elsewhere in ContainerCreating with a Multi-Attach error.
The operator reads the claim (a GET, at most every `RECHECK_SECONDS`) and says so in the warning
condition `ModelVolumeNotShareable`; nothing is refused (a single-node cluster may be fine).
A claim it cannot read (missing, or RBAC that does not grant it) makes the condition Unknown.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from berth.operator.crd_model import LLMDeploymentSpec
from berth.operator.kube import Kube, KubeError

CONDITION = "ModelVolumeNotShareable"
# Modes that let pods on several nodes mount the claim at once.
SHAREABLE_MODES = ("ReadOnlyMany", "ReadWriteMany")
RECHECK_SECONDS = 60.0


@dataclass(frozen=True)
class ClaimRead:
    """What a GET of the claim answered: the claim, or None and the API server's error."""

    name: str
    claim: dict[str, Any] | None
    error: str | None = None


def mounting_pods(spec: LLMDeploymentSpec) -> int:
    """Pods that mount the model volume: the launcher and every worker pod of every world."""
    return sum(1 + spec.nodes_of(world) for world in range(spec.replicas))


def access_modes(claim: dict[str, Any]) -> list[str]:
    """The modes of the volume bound to the claim, or those it asks for while unbound."""
    return list(
        (claim.get("status") or {}).get("accessModes") or (claim.get("spec") or {}).get("accessModes") or []
    )


def _condition(status: str, reason: str, message: str) -> dict[str, Any]:
    return {"type": CONDITION, "status": status, "reason": reason, "message": message}


def condition(spec: LLMDeploymentSpec, read: ClaimRead | None) -> dict[str, Any]:
    """The `ModelVolumeNotShareable` condition for `spec`, given the claim as last read."""
    volume = spec.model.volume
    if volume is None or volume.persistent_volume_claim is None or read is None:
        return _condition("False", "NoClaim", "the model volume is not a PersistentVolumeClaim")
    name = volume.persistent_volume_claim.claim_name
    if read.claim is None:
        reason = "ClaimNotFound" if read.error is None else "ClaimUnreadable"
        why = "does not exist" if read.error is None else f"could not be read: {read.error}"
        return _condition(
            "Unknown",
            reason,
            f"PersistentVolumeClaim {name} of the model volume {why}; its access modes are unknown",
        )
    modes = access_modes(read.claim)
    pods = mounting_pods(spec)
    if any(mode in SHAREABLE_MODES for mode in modes) or pods <= 1:
        return _condition(
            "False",
            "Shareable",
            f"PersistentVolumeClaim {name} ({', '.join(modes) or 'no access modes'}) "
            f"can be mounted by the {pods} pod(s) that use it",
        )
    only = "one pod" if "ReadWriteOncePod" in modes else "the pods of one node"
    return _condition(
        "True",
        "ReadWriteOncePod" if "ReadWriteOncePod" in modes else "ReadWriteOnce",
        f"PersistentVolumeClaim {name} of the model volume is {', '.join(modes)}: only {only} can mount it, "
        f"but {pods} pods do (the launcher and the worker pods of each of "
        f"{spec.replicas} world(s), on different nodes as a rule); the others stay ContainerCreating "
        "(Multi-Attach error). Use a ReadOnlyMany or ReadWriteMany claim, or an nfs model volume",
    )


class ClaimWatch:
    """The model volume's claim, read again when its name changes or `RECHECK_SECONDS` passed."""

    def __init__(self) -> None:
        self._read: ClaimRead | None = None
        self._at: dt.datetime | None = None

    async def read(
        self, kube: Kube, namespace: str, spec: LLMDeploymentSpec, now: dt.datetime
    ) -> ClaimRead | None:
        volume = spec.model.volume
        if volume is None or volume.persistent_volume_claim is None:
            self._read = self._at = None
            return None
        name = volume.persistent_volume_claim.claim_name
        fresh = self._at is not None and (now - self._at).total_seconds() < RECHECK_SECONDS
        if self._read is not None and self._read.name == name and fresh:
            return self._read
        try:
            read = ClaimRead(name, await kube.get("v1", "PersistentVolumeClaim", namespace, name))
        except KubeError as error:  # a 403 (RBAC without the grant) is shown, never fatal
            read = ClaimRead(name, None, f"HTTP {error.status}: {error.message}")
        self._read, self._at = read, now
        return read
