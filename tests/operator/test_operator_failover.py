"""Two operator processes, one Lease: `kill -9` of the leader during a rolling change, and a
leader that cannot renew.

Both processes run the operator's real entry point (leader election + kopf) against the
emulator, under the shipped cluster-wide RBAC (leases included); their polls and admin calls
reach the engines through recording proxies, which count what each launcher pod received.
The standby takes over after the lease expires (never before: the old leader might still act),
the rollout finishes, no world is replaced twice and no pod receives a transition twice. Then the
new leader is cut off from its Lease: it stops acting (exits) before the Lease can expire.
The election runs beside kopf's event loop: a leader whose loop is blocked for twice the lease
duration keeps its Lease, and one cut off while blocked still exits in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from berth.operator.restarts import parse_time
from tests.operator.test_operator_cli import answers
from tests.operator.test_operator_rbac import OPERATOR_AGENTS, install
from tests.operator.test_operator_rollout import (
    LAUNCHERS,
    ROLLOUT_TIMEOUT,
    patch_spec,
    rollout_complete,
    status,
)
from tests.operator.test_operator_rollout import two_ready_worlds as apply_two_worlds
from tests.support.cluster import Cluster, ClusterSim, sampling, wait_for
from tests.support.engine_endpoint import EngineFleet, free_port
from tests.support.rbac import Authorizer
from tests.support.recording_proxy import RecordingResolver, recording

# A script, not `-m`: `tests` is a package of the test session only (tests/conftest.py).
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "operator_process.py"
LEASES = "coordination.k8s.io/v1/leases"
LEASE_NAMESPACE = "berth-system"
# Short, to keep the test short; the same rules as the defaults (renew < deadline, deadline +
# the stop grace < lease).
LEASE_SECONDS, RENEW_SECONDS, DEADLINE_SECONDS = 6.0, 1.0, 3.0


def lease(cluster: Cluster) -> dict[str, Any]:
    return (cluster.get(LEASES, "berth-operator", LEASE_NAMESPACE) or {}).get("spec") or {}


@contextlib.asynccontextmanager
async def operator_process(
    cluster: Cluster,
    addresses: Path,
    log: Path,
    liveness: str = "",
    stall: float = 0.0,
    stall_when_leading: bool = False,
) -> AsyncIterator[asyncio.subprocess.Process]:
    with log.open("wb") as output:
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), "--addresses", str(addresses), "--stall-on-sigusr1", str(stall),
            "--namespace", cluster.namespace, "--kubeconfig", str(cluster.kubeconfig),
            "--metrics-port", "0", "--liveness", liveness, "--lease-namespace", LEASE_NAMESPACE,
            "--lease-duration", str(LEASE_SECONDS), "--lease-renew-interval", str(RENEW_SECONDS),
            "--lease-renew-deadline", str(DEADLINE_SECONDS),
            *(["--stall-when-leading"] if stall_when_leading else []),
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=output, stderr=output,
        )  # fmt: skip
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await asyncio.wait_for(process.wait(), 30)


def publisher(cluster: Cluster, resolver: RecordingResolver, path: Path):
    """Writes `path`: each running launcher pod's uid -> its recording proxy's address."""

    async def publish() -> None:
        addresses = {}
        for pod in cluster.objects("v1/pods"):
            if EngineFleet.is_launcher(pod) and (address := await resolver(pod)) is not None:
                addresses[pod["metadata"]["uid"]] = list(address)
        path.with_suffix(".tmp").write_text(json.dumps(addresses))
        path.with_suffix(".tmp").replace(path)

    return publish


def transitions(resolver: RecordingResolver) -> Counter[tuple[str, str]]:
    """(pod uid, admin path) -> how many times a transition was sent there."""
    return Counter(
        (r.uid, r.path)
        for r in resolver.requests
        if r.method == "POST" and r.path in ("/admin/sleep", "/admin/wakeup")
    )


async def cut_off_exits_in_time(
    cluster: Cluster, leader: asyncio.subprocess.Process, stall: bool = False
) -> None:
    """Refuses the leader's Lease updates (and, with `stall`, blocks its loop): it must exit 1
    before its last renewal + the lease duration, when a standby may take over."""
    cluster.emulator.deny("update", "leases", "berth-operator", "cut off (test)", status=503)
    if stall:
        leader.send_signal(signal.SIGUSR1)
        await asyncio.sleep(0.5)  # a renewal already past the check has landed
    last = parse_time(lease(cluster)["renewTime"])
    await wait_for(lambda: leader.returncode is not None, 30, "the cut-off leader exited")
    exited = dt.datetime.now(dt.timezone.utc)
    assert leader.returncode == 1
    assert exited < last + dt.timedelta(seconds=LEASE_SECONDS), (exited, last)


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_the_standby_takes_over_a_rollout_from_a_killed_leader_and_repeats_nothing(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    docs, _ = install("cluster", cluster.namespace)
    cluster.emulator.authorizer = Authorizer(docs).refusal
    cluster.emulator.operator_agents = OPERATOR_AGENTS
    addresses = tmp_path / "addresses.json"
    addresses.write_text("{}")
    async with (
        recording(fleet.resolve) as resolver,
        sampling(publisher(cluster, resolver, addresses), 0.1),
        operator_process(cluster, addresses, tmp_path / "a.log") as first,
    ):
        await wait_for(lambda: lease(cluster).get("holderIdentity"), 60, "the first operator leading")
        leader = lease(cluster)["holderIdentity"]
        liveness = f"http://127.0.0.1:{free_port()}/healthz"
        async with operator_process(cluster, addresses, tmp_path / "b.log", liveness) as second:
            await apply_two_worlds(cluster, tmp_path, fleet.model)
            assert lease(cluster)["holderIdentity"] == leader, "the standby never took the lease"
            # Standing by is healthy: its liveness probe passes (its pod is not restarted).
            assert await answers(liveness, '"standby": true')
            await patch_spec(cluster, {"env": [{"name": "BERTH_ROLLOUT_TEST", "value": "failover"}]})
            # Mid-rollout: world 0 drained and its new pods starting, world 1 still to do.
            await wait_for(
                lambda: fleet.started.count("llama-w0-launcher") == 2, ROLLOUT_TIMEOUT, "world 0 replaced"
            )
            renewed = parse_time(lease(cluster)["renewTime"])
            first.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            took_over = await wait_for(
                lambda: lease(cluster).get("holderIdentity") not in (None, leader), 60, "the standby leading"
            )
            taken_after = time.monotonic() - killed
            successor = lease(cluster)
            await wait_for(lambda: rollout_complete(cluster), ROLLOUT_TIMEOUT, "the rollout finished")

            assert took_over
            # Not before the lease expired (the killed leader's last renewal + its duration) ...
            assert parse_time(successor["acquireTime"]) >= renewed + dt.timedelta(seconds=LEASE_SECONDS)
            # ... and within about its duration after the kill (plus one attempt of the standby).
            assert taken_after <= LEASE_SECONDS + 3 * RENEW_SECONDS, taken_after
            assert successor["leaseTransitions"] == 1
            # Each world replaced exactly once, no transition sent twice to a pod, no restart.
            assert sorted(fleet.started) == sorted([*LAUNCHERS, *LAUNCHERS])
            sent = transitions(resolver)
            assert sent and max(sent.values()) == 1, sent
            assert [world.get("restarts", 0) for world in status(cluster)["worlds"]] == [0, 0]
            assert cluster.emulator.forbidden == []

            # The leader cut off from its Lease stops acting before the Lease can expire.
            await cut_off_exits_in_time(cluster, second)
    log = (tmp_path / "b.log").read_text()
    assert "lost the lease" in log, log[-3000:]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_blocked_leader_keeps_its_lease_and_one_cut_off_while_blocked_still_exits_in_time(
    cluster: Cluster, tmp_path: Path
) -> None:
    addresses = tmp_path / "addresses.json"
    addresses.write_text("{}")
    stall = 2 * LEASE_SECONDS
    log = tmp_path / "operator.log"
    async with operator_process(cluster, addresses, log, stall=stall, stall_when_leading=True) as leader:
        # kopf's loop blocked for longer than the Lease lasts, from the moment the Lease is
        # taken (before that loop hears of it): the renewals go on regardless.
        await wait_for(lambda: lease(cluster).get("holderIdentity"), 60, "the operator leading")
        blocked = time.monotonic()
        holder = lease(cluster)["holderIdentity"]
        renewals = set()
        while time.monotonic() - blocked < stall + 1:
            renewals.add(lease(cluster)["renewTime"])
            await asyncio.sleep(0.25)
        assert len(renewals) >= stall / RENEW_SECONDS / 2, sorted(renewals)
        assert leader.returncode is None
        assert lease(cluster)["holderIdentity"] == holder

        # Cut off from its Lease while blocked: its loop cannot stop kopf, the election's thread
        # ends the process before the Lease can expire.
        await cut_off_exits_in_time(cluster, leader, stall=True)
    said = log.read_text()
    assert "lost the lease" in said and "did not stop within" in said, said[-3000:]
