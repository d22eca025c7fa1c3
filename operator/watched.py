"""Every LLMDeployment's children, fed by watches instead of read from the API server per round.

Each deployment's health round needs its pods and its StatefulSets, and its resync (the full
reconcile that repairs children changed behind the operator's back) needs every child. Reading
them from the API server costs two LISTs per deployment every few seconds, and a GET of every
child and a LIST of every kind per resync: at a thousand deployments, hundreds of requests a
second, which a real API server's priority and fairness throttles (and every LIST is a scan of
all objects of its kind). Instead kopf indexes (handlers.py) keep every berth-labelled object of
the kinds the operator makes, as the watch last delivered it, keyed by (namespace, deployment);
rounds and resyncs read them from memory. Secrets are not among them: the operator may not list
or watch Secrets (least privilege), so it reads its own by name.

A watch lags the API server by the time an event takes to arrive, and under load by far more
than a round: a loop that deleted a world's outdated pods would still see them next round, and
delete their successors (same names) again and again. So each loop keeps `Expectations` of its
own writes, as Kubernetes' controllers do: until the watches show every pod it deleted as gone
or terminating, and every pod it created, its rounds list from the API server instead. A resync
tolerates lag: a stale object is at worst applied once more (an apply is idempotent), and an
object the watches do not show yet is read from the API server before anything is created.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Mapping
from typing import Any

from berth.operator.kube import has_labels

Key = tuple[str, str]  # (namespace, deployment)


def entry(body: Mapping[str, Any], namespace: str, deployment: str) -> dict[Key, dict[str, Any]]:
    """An index entry: the object (a plain copy: a watch body is not ours to keep) under its key,
    without its managedFields (never read here, and often the bulk of a pod to copy and keep)."""
    meta = {key: value for key, value in body["metadata"].items() if key != "managedFields"}
    return {(namespace, deployment): copy.deepcopy({**body, "metadata": meta})}


class WatchedChildren:
    """Reads a deployment's children of the watched kinds (handlers.WATCHED) from their indexes."""

    def __init__(self, indexes: Mapping[str, Mapping[Key, Any]]) -> None:
        self._by_kind = dict(indexes)

    @property
    def kinds(self) -> list[str]:
        return list(self._by_kind)

    def of(self, kind: str, namespace: str, deployment: str) -> list[dict[str, Any]]:
        index = self._by_kind[kind]
        return list(index.get((namespace, deployment), ()))

    def seen(self, namespace: str, deployment: str) -> Seen:
        """One deployment's children of every watched kind as the watches show them now."""
        return Seen({kind: self.of(kind, namespace, deployment) for kind in self._by_kind})


class Seen:
    """One deployment's children as the watches showed them, for the kinds they cover; the
    other kinds are read from the API server (a kind left out is not known to be absent)."""

    def __init__(self, objects: Mapping[str, list[dict[str, Any]]]) -> None:
        self._by_kind = {
            kind: {obj["metadata"]["name"]: obj for obj in found} for kind, found in objects.items()
        }

    def covers(self, kind: str) -> bool:
        return kind in self._by_kind

    def named(self, kind: str, name: str) -> dict[str, Any] | None:
        """The object if the watches show it (None: not shown, which is not proof it is absent)."""
        return self._by_kind.get(kind, {}).get(name)

    def labelled(self, kind: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """The objects of a covered kind that carry every one of `labels`."""
        return [obj for obj in self._by_kind[kind].values() if has_labels(obj, labels)]


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
