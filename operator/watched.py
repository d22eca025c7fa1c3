"""The pods and StatefulSets of every LLMDeployment, fed by watches instead of listed per round.

Each deployment's health round needs its pods and its StatefulSets. Listing them from the API
server every round costs two LISTs per deployment every few seconds: at a thousand deployments,
hundreds of LISTs a second, which a real API server's priority and fairness throttles. Instead
two kopf indexes (handlers.py) keep every berth-labelled pod and StatefulSet, as the watch last
delivered it, keyed by (namespace, deployment); a round reads them from memory.

A watch lags the API server by the time an event takes to arrive: a pod created or deleted a
moment ago may be missing or still present. The rounds already tolerate that (they act on what
they see and look again a round later, as any controller on an informer cache does).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

Key = tuple[str, str]  # (namespace, deployment)


def entry(body: Mapping[str, Any], namespace: str, deployment: str) -> dict[Key, dict[str, Any]]:
    """An index entry: the object (a plain copy: a watch body is not ours to keep) under its key."""
    return {(namespace, deployment): copy.deepcopy(dict(body))}


class WatchedChildren:
    """Reads a deployment's pods and StatefulSets from the two indexes."""

    def __init__(self, pods: Mapping[Key, Any], statefulsets: Mapping[Key, Any]) -> None:
        self._by_kind = {"Pod": pods, "StatefulSet": statefulsets}

    def of(self, kind: str, namespace: str, deployment: str) -> list[dict[str, Any]]:
        index = self._by_kind[kind]
        return list(index.get((namespace, deployment), ()))
