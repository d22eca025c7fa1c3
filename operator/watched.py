"""The pods and StatefulSets of every LLMDeployment, fed by watches instead of listed per round.

Each deployment's health round needs its pods and its StatefulSets. Listing them from the API
server every round costs two LISTs per deployment every few seconds: at a thousand deployments,
hundreds of LISTs a second, which a real API server's priority and fairness throttles. Instead
two kopf indexes (handlers.py) keep every berth-labelled pod and StatefulSet, as the watch last
delivered it, keyed by (namespace, deployment); a round reads them from memory.

A watch lags the API server by the time an event takes to arrive, and under load by far more
than a round: a loop that deleted a world's outdated pods would still see them next round, and
delete their successors (same names) again and again. So each loop keeps `Expectations` of its
own writes, as Kubernetes' controllers do: until the watches show every pod it deleted as gone
or terminating, and every pod it created, its rounds list from the API server instead.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Mapping
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


EXPECTATION_TTL = 300.0  # seconds: a write the watches never show stops forcing LISTs after this


class Expectations:
    """This loop's writes of one kind of object that the watches have not shown yet."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._deleted: dict[str, float] = {}  # uid -> when
        self._created: dict[str, float] = {}  # name -> when

    def deleted(self, uid: str) -> None:
        self._deleted[uid] = self._clock()

    def created(self, name: str) -> None:
        self._created[name] = self._clock()

    def met_by(self, objects: Iterable[Mapping[str, Any]]) -> bool:
        """Whether `objects` (the watches' view) shows every write; forgets those it shows."""
        live = {
            obj["metadata"]["uid"]: obj["metadata"]["name"]
            for obj in objects
            if not obj["metadata"].get("deletionTimestamp")
        }
        expired = self._clock() - EXPECTATION_TTL
        self._deleted = {uid: at for uid, at in self._deleted.items() if uid in live and at > expired}
        present = {name for uid, name in live.items() if uid not in self._deleted}
        self._created = {
            name: at for name, at in self._created.items() if name not in present and at > expired
        }
        return not self._deleted and not self._created
