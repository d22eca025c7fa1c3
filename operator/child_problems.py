"""What stands in the way of a deployment's children, remembered between rounds:

- objects with a child's name that this LLMDeployment does not control (no controller reference
  to its UID). They are never patched, deleted, mounted or read: adopting a user's Service or
  Secret would hand it to the garbage collector with the LLMDeployment, and reading a Secret
  someone else made would send its value to a pod running the user's image;
- writes the API server refused (403 from admission, a quota or a webhook; 422 as invalid),
  with the server's message verbatim, retried with exponential backoff while the other worlds
  go on being supervised. A 422 on a StatefulSet's immutable fields is marked: that world's
  StatefulSet is replaced (drained first, like any rollout), not patched.

The reconcile (reconcile.py) and the health loop (supervisor.py) both report here; the health
loop writes it into status and posts one Event per new problem.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from berth.operator.restarts import format_time

RETRY_SECONDS = 5.0
MAX_RETRY_SECONDS = 300.0
# The API server's words for an update of a StatefulSet field that can never change.
IMMUTABLE_STATEFULSET = "updates to statefulset spec for fields other than"


@dataclass(frozen=True)
class ConflictingObject:
    kind: str
    name: str
    owner: str  # "nobody", or Kind/name (uid) of its controller
    world: int | None  # None: the whole deployment needs it

    @property
    def ref(self) -> str:
        return f"{self.kind}/{self.name}"

    def describe(self) -> str:
        needed = f"world {self.world}" if self.world is not None else "the deployment"
        return (
            f"{self.ref} exists and is controlled by {self.owner}, not by this LLMDeployment: "
            f"{needed} needs that name; delete or rename the object (it is never adopted)"
        )

    def status(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"kind": self.kind, "name": self.name, "owner": self.owner}
        if self.world is not None:
            entry["world"] = self.world
        return entry


@dataclass(frozen=True)
class RefusedWrite:
    """One refusal as a write reports it (reconcile.Outcome, the health loop's own writes)."""

    ref: str
    verb: str
    code: int
    message: str
    world: int | None

    @property
    def immutable(self) -> bool:
        return (
            self.ref.startswith("StatefulSet/") and self.code == 422 and IMMUTABLE_STATEFULSET in self.message
        )


@dataclass
class Refusal:
    """A refused write as remembered: since when, how often, when to try again."""

    write: RefusedWrite
    first: dt.datetime
    last: dt.datetime
    retries: int
    next_retry: dt.datetime

    def status(self) -> dict[str, Any]:
        return {
            "object": self.write.ref,
            "verb": self.write.verb,
            "code": self.write.code,
            "message": self.write.message,
            "time": format_time(self.first),
            "lastTime": format_time(self.last),
            "retries": self.retries,
            "nextRetry": format_time(self.next_retry),
        }


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ownerReference with `controller: true`, if any (there is at most one)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref
    return None


def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    controller = controller_of(obj)
    return controller is not None and controller.get("uid") == uid


def describe_controller(obj: Mapping[str, Any]) -> str:
    controller = controller_of(obj)
    if controller is None:
        return "nobody"
    return f"{controller.get('kind')}/{controller.get('name')} (uid {controller.get('uid')})"


@dataclass
class ChildProblems:
    conflicts: dict[str, ConflictingObject] = field(default_factory=dict)
    refusals: dict[str, Refusal] = field(default_factory=dict)

    def set_conflicts(self, found: list[ConflictingObject]) -> list[tuple[str, str, str]]:
        """A full reconcile's view replaces the last; returns the Events for new conflicts."""
        new = {conflict.ref: conflict for conflict in found}
        events = [
            ("Warning", "ConflictingObject", conflict.describe())
            for ref, conflict in new.items()
            if self.conflicts.get(ref) != conflict
        ]
        self.conflicts = new
        return events

    def refused(self, write: RefusedWrite, now: dt.datetime) -> list[tuple[str, str, str]]:
        """Remember a refusal; returns an Event when it is new or the server says something new."""
        known = self.refusals.get(write.ref)
        retries = known.retries + 1 if known is not None else 1
        delay = min(RETRY_SECONDS * 2 ** (retries - 1), MAX_RETRY_SECONDS)
        self.refusals[write.ref] = Refusal(
            write=write,
            first=known.first if known is not None else now,
            last=now,
            retries=retries,
            next_retry=now + dt.timedelta(seconds=delay),
        )
        if known is not None and known.write == write:
            return []
        what = "replacing the world's StatefulSet" if write.immutable else f"retrying in {delay:.0f}s"
        return [
            (
                "Warning",
                "WriteRefused",
                f"{write.verb} {write.ref} refused by the API server (HTTP {write.code}): "
                f"{write.message}; {what}",
            )
        ]

    def succeeded(self, ref: str) -> None:
        self.refusals.pop(ref, None)

    def waiting(self, ref: str, now: dt.datetime) -> bool:
        """True while a refused write of `ref` is backing off."""
        refusal = self.refusals.get(ref)
        return refusal is not None and refusal.next_retry > now

    def reconcile_due(self, now: dt.datetime) -> bool:
        """A refused write of the reconcile's is due again (pods are the health loop's to retry)."""
        return any(not ref.startswith("Pod/") and r.next_retry <= now for ref, r in self.refusals.items())

    def seconds_until_retry(self, now: dt.datetime) -> float | None:
        """Until the next retry still ahead (one already due waits for its round, not a busy loop)."""
        ahead = [(r.next_retry - now).total_seconds() for r in self.refusals.values() if r.next_retry > now]
        return min(ahead) if ahead else None

    def forget_worlds_from(self, replicas: int) -> None:
        """Worlds scaled away create nothing any more (their deletions are still retried)."""
        for ref, refusal in list(self.refusals.items()):
            world = refusal.write.world
            if world is not None and world >= replicas and refusal.write.verb in ("create", "apply"):
                del self.refusals[ref]

    def world_conflicts(self, world: int) -> list[ConflictingObject]:
        """Conflicts that keep world `world` from running: its own children's, and a Secret's
        (every pod mounts the deployment's Secrets)."""
        return [
            conflict
            for conflict in self.conflicts.values()
            if conflict.world == world or conflict.kind == "Secret"
        ]

    def immutable_statefulset(self, world_name: str) -> bool:
        refusal = self.refusals.get(f"StatefulSet/{world_name}")
        return refusal is not None and refusal.write.immutable

    def world_errors(self, world: int) -> list[dict[str, Any]]:
        return [r.status() for _, r in sorted(self.refusals.items()) if r.write.world == world]

    def deployment_errors(self) -> list[dict[str, Any]]:
        return [r.status() for _, r in sorted(self.refusals.items()) if r.write.world is None]

    def conflicts_status(self) -> list[dict[str, Any]]:
        return [conflict.status() for _, conflict in sorted(self.conflicts.items())]
