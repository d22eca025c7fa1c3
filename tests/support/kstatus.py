"""kstatus, the status rules Argo CD, Flux and `kubectl wait`-style tooling read a custom
resource by (sigs.k8s.io/cli-utils pkg/kstatus/status, "generic" rules for a kind it does not
know), written from its documentation for the tests: they judge the operator's real status."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def kstatus(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(Current | InProgress | Failed | Terminating, message) of an object."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "Terminating", "resource scheduled for deletion"
    generation, observed = meta.get("generation"), status.get("observedGeneration")
    if generation is not None and observed is not None and observed != generation:
        return "InProgress", f"resource is being reconciled: generation {generation}, observed {observed}"
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    reconciling, stalled = conditions.get("Reconciling"), conditions.get("Stalled")
    if reconciling is not None and reconciling.get("status") == "True":
        return "InProgress", reconciling.get("message") or ""
    if stalled is not None and stalled.get("status") == "True":
        return "Failed", stalled.get("message") or ""
    return "Current", "resource is current"
