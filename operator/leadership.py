"""One actor among the operator's replicas: leader election through a `coordination.k8s.io/v1`
Lease, the way client-go's leaderelection does it.

- A candidate takes the Lease when it is free, or when its record (holder, renewTime) has not
  changed for `lease_seconds` *as this candidate observed it* (its own monotonic clock, so the
  holders' clock skew does not matter). Every write carries the resourceVersion it read: of two
  candidates writing at once, the API server refuses the second (409), never two holders.
- The holder renews every `renew_seconds`. If it has not renewed for `deadline_seconds`
  (< `lease_seconds`), it has lost: `hold()` returns, and the caller stops acting, at the
  latest `STOP_GRACE` later, which is still before any other candidate may take the Lease.
- A holder that stops cleanly gives the Lease up (an empty holder), so its successor takes
  over at once instead of after the lease duration.

kopf's peering is not used: it is a priority scheme over annotations, with no lease semantics.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Mapping
from typing import Any

from berth.operator.kube import MERGE_PATCH, Conflict, Kube, KubeError, NotFound
from berth.operator.restarts import format_time

API_VERSION = "coordination.k8s.io/v1"
LEASE_NAME = "berth-operator"
LEASE_SECONDS = 15.0
RENEW_SECONDS = 2.0
DEADLINE_SECONDS = 10.0
# After losing the lease, how long the operator may take to stop before the process exits hard.
STOP_GRACE = 2.0

logger = logging.getLogger("berth.operator.leadership")


def timing_problem(
    lease_seconds: float = LEASE_SECONDS,
    renew_seconds: float = RENEW_SECONDS,
    deadline_seconds: float = DEADLINE_SECONDS,
) -> str | None:
    """Why these timings cannot keep "one actor" (None when they can): a leader must try to
    renew before its deadline, and stop (deadline + STOP_GRACE) before its Lease can expire."""
    if 0 < renew_seconds < deadline_seconds and deadline_seconds + STOP_GRACE < lease_seconds:
        return None
    return (
        f"leader election needs 0 < renew interval ({renew_seconds:g}) < renew deadline "
        f"({deadline_seconds:g}) and renew deadline + {STOP_GRACE:g} s < lease duration ({lease_seconds:g})"
    )


def _now() -> str:
    return format_time(dt.datetime.now(dt.timezone.utc))


class LeaseElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        identity: str,
        *,
        name: str = LEASE_NAME,
        lease_seconds: float = LEASE_SECONDS,
        renew_seconds: float = RENEW_SECONDS,
        deadline_seconds: float = DEADLINE_SECONDS,
    ) -> None:
        problem = timing_problem(lease_seconds, renew_seconds, deadline_seconds)
        if problem:
            raise ValueError(problem)
        self.kube = kube
        self.namespace = namespace
        self.identity = identity
        self.name = name
        self.lease_seconds = lease_seconds
        self.renew_seconds = renew_seconds
        self.deadline_seconds = deadline_seconds
        # The record as last seen, and when (monotonic): a record unchanged for lease_seconds
        # is expired, whatever its timestamps say.
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._lease: dict[str, Any] | None = None  # the Lease as last read or written
        self.last_renewed = 0.0  # monotonic time of the last successful acquire or renewal

    @property
    def path(self) -> str:
        return f"/apis/{API_VERSION}/namespaces/{self.namespace}/leases/{self.name}"

    def _spec(self, *, transitions: int, acquired: str | None) -> dict[str, Any]:
        now = _now()
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_seconds)),
            "acquireTime": acquired or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def _observe(self, lease: Mapping[str, Any]) -> None:
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()

    async def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this candidate holds the Lease afterwards."""
        try:
            lease = await self.kube.request("GET", self.path)
        except NotFound:
            lease = None
        if lease is None:
            body = {
                "apiVersion": API_VERSION,
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(transitions=0, acquired=None),
            }
            collection = self.path.rsplit("/", 1)[0]
            try:
                self._lease = await self.kube.request("POST", collection, body)
            except Conflict:
                return False  # another candidate created it first
            return self._held()
        self._observe(lease)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or None
        mine = holder == self.identity
        expired = time.monotonic() - self._observed_at >= self.lease_seconds
        if holder is not None and not mine and not expired:
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        try:
            self._lease = await self._write(
                lease, self._spec(transitions=transitions, acquired=spec.get("acquireTime") if mine else None)
            )
        except Conflict:
            return False
        if not mine:
            logger.info("took the lease %s/%s over from %r", self.namespace, self.name, holder)
        return self._held()

    async def _write(self, read: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
        """A merge patch conditional on the resourceVersion read: if anyone wrote the Lease in
        between, the API server refuses it (409), as it would an update."""
        patch = {"metadata": {"resourceVersion": read["metadata"]["resourceVersion"]}, "spec": dict(spec)}
        return await self.kube.request("PATCH", self.path, patch, content_type=MERGE_PATCH)

    def _held(self) -> bool:
        self.last_renewed = time.monotonic()
        self._observe(self._lease or {})
        return True

    async def acquire(self) -> None:
        """Waits (a standby) until this candidate holds the Lease."""
        logger.info("candidate %r for the lease %s/%s", self.identity, self.namespace, self.name)
        while True:
            try:
                if await asyncio.wait_for(self.try_acquire_or_renew(), self.renew_seconds * 2):
                    logger.info("leading as %r", self.identity)
                    return
            except (KubeError, TimeoutError) as error:
                logger.warning("cannot read or take the lease (will retry): %s", error)
            await asyncio.sleep(self.renew_seconds)

    async def hold(self) -> None:
        """Renews the Lease every renew_seconds; returns once leadership is lost: another holder
        took it, or no renewal succeeded for deadline_seconds (noticed at the deadline itself,
        not at the next attempt after it)."""
        while True:
            await asyncio.sleep(min(self.renew_seconds, max(self._left(), 0.0)))
            left = self._left()
            if left <= 0:
                logger.error(
                    "lost the lease %s/%s: no renewal for %.0f s",
                    self.namespace,
                    self.name,
                    self.deadline_seconds,
                )
                return
            try:
                if not await asyncio.wait_for(self.try_acquire_or_renew(), left):
                    logger.error("lost the lease %s/%s: another replica holds it", self.namespace, self.name)
                    return
            except (KubeError, TimeoutError) as error:
                logger.warning(
                    "cannot renew the lease (will retry until the deadline): %s", error or "timed out"
                )

    def _left(self) -> float:
        """Seconds until the renew deadline."""
        return self.deadline_seconds - (time.monotonic() - self.last_renewed)

    async def release(self) -> None:
        """Gives the Lease up (a clean stop): the next candidate takes it at its next attempt."""
        if self._lease is None:
            return
        released = {"holderIdentity": None, "leaseDurationSeconds": 1}
        try:
            await asyncio.wait_for(self._write(self._lease, released), self.renew_seconds * 2)
        except (KubeError, TimeoutError) as error:
            logger.warning("could not give the lease up (it expires by itself): %s", error)
