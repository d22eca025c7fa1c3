"""Autoscaling on real pods: the operator, the cluster's controllers and the test kubelet running
every rendered command (tests/support/e2e.py), worlds of one rank on the tiny model.

A test client sends a bounded load to the deployment's Service (each request to one of its
ready endpoints, as kube-proxy spreads them): world 0's queue grows, the operator reads the
queue depth from its engine and adds worlds up to maxReplicas, and the new worlds take their
share of the load. The load stops; maxReplicas lowered to 2 drains world 2, whose requests in
flight end in full before its pods go. Then, with no request, after idle.sleepAfterSeconds the
world beyond minAwake sleeps in its processes, after idle.releaseAfterSeconds it is released
(its pods deleted); world 0 still answers. Every request of the load completed, the spec was
never written by the operator, and its /metrics carried the figures.

The scale-down the load decides, with a test-sized stabilization window: two worlds serve a
load, which pauses (the metric says one world is enough) and comes back within the window: the
count holds (no flap). Once the load has stopped for good, one world is removed, only after the
window, once.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from berth.operator import naming
from berth.operator.metrics import metrics
from tests.support import e2e
from tests.support.cluster import Cluster, wait_for
from tests.support.kubelet import Kubelet
from tests.support.watch_log import Change, watching

START_TIMEOUT = 150.0
CLIENTS, MAX_TOKENS = 6, 48
DRAINED, DRAINED_TOKENS = 3, 400  # requests in flight on a world that autoscaling removes


async def load(
    llmd: e2e.Deployed,
    stop: asyncio.Event,
    results: list[tuple[str, int]],
    targets: Callable[[], list[str]] | None = None,
) -> None:
    """CLIENTS clients, each sending one request after the other until `stop`: every request
    goes to one of `targets()` (default: the Service's ready endpoints), round robin. Results:
    (endpoint, HTTP status)."""
    turn = itertools.count()
    targets = targets or llmd.endpoints

    async def client(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            endpoints = sorted(targets())
            if not endpoints:
                await asyncio.sleep(0.1)
                continue
            endpoint = endpoints[next(turn) % len(endpoints)]
            request = {
                "model": "tiny",
                "prompt": "the quick brown fox",
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "temperature": 0,
            }
            reply = await http.post(
                f"http://{endpoint}:{naming.ENGINE_PORT}/v1/completions", json=request, timeout=120
            )
            finished = (
                reply.json()["usage"]["completion_tokens"] == MAX_TOKENS
                if reply.status_code == 200
                else False
            )
            results.append((endpoint, reply.status_code if finished else -reply.status_code))

    async with httpx.AsyncClient() as http:
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))


async def drained_request(ip: str) -> tuple[int, int, float]:
    """A long request straight to one world: (HTTP status, tokens, when it ended)."""
    request = {"model": "tiny", "prompt": "hello", "max_tokens": DRAINED_TOKENS, "ignore_eos": True}
    async with httpx.AsyncClient() as http:
        reply = await http.post(f"http://{ip}:{naming.ENGINE_PORT}/v1/completions", json=request, timeout=120)
    tokens = reply.json()["usage"]["completion_tokens"] if reply.status_code == 200 else 0
    return reply.status_code, tokens, time.monotonic()


def busy(ip: str) -> bool:
    """A request running and another waiting on the engine at `ip` (its /metrics)."""
    try:
        text = httpx.get(f"http://{ip}:{naming.ENGINE_PORT}/metrics", timeout=5).text
    except httpx.HTTPError:
        return False
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("berth_num_requests_running{", "berth_num_requests_waiting{"))
    }
    return (
        values.get("berth_num_requests_running", 0) >= 1 and values.get("berth_num_requests_waiting", 0) >= 1
    )


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_load_adds_worlds_up_to_max_then_idle_worlds_sleep_and_are_released(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "metric": "queueDepth",
        "target": 1,
        "windowSeconds": 2,
        "scaleDown": {"stabilizationWindowSeconds": 600},  # the idle tiers act first here
        "idle": {"sleepAfterSeconds": 6, "minAwake": 1, "level": 1, "releaseAfterSeconds": 6, "minWorlds": 1},
    }
    manifest = e2e.tiny_cpu_example(
        models,
        replicas=1,
        health=e2e.FAST_HEALTH,
        engineArgs=["--max-num-seqs=1"],
        rollout={"drainTimeoutSeconds": 120},
        autoscaling=autoscaling,
    )
    manifest["spec"]["model"]["name"] = "tiny"
    results: list[tuple[str, int]] = []
    seen_worlds: list[int] = []

    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        await llmd.wait(lambda: llmd.status().get("readyReplicas") == 1, START_TIMEOUT, "world 0 Ready")
        spec_before = llmd.get()["spec"]
        stop = asyncio.Event()
        clients = asyncio.create_task(load(llmd, stop, results))
        try:

            def three_serving() -> bool:
                seen_worlds.append(len(llmd.status().get("worlds") or []))
                served = {endpoint for endpoint, _ in results}
                return llmd.status().get("readyReplicas") == 3 and len(served) >= 3

            await llmd.wait(three_serving, START_TIMEOUT, "three worlds Ready, each serving the load")
            scaled_up = llmd.status()
            exported = generate_latest(metrics().registry).decode()
        finally:
            stop.set()
            await asyncio.wait_for(clients, 120)

        # Requests running and queued on world 2, then maxReplicas lowered to 2: world 2 drains
        # them to their end before its pods go.
        world2 = llmd.pod_status(naming.launcher_pod_name("tiny", 2))["podIP"]
        in_flight = [asyncio.ensure_future(drained_request(world2)) for _ in range(DRAINED)]
        await llmd.wait(lambda: busy(world2), 30, "requests running and queued on world 2")
        lowered = {"spec": {"autoscaling": {"maxReplicas": 2}}}
        await cluster.kubectl("patch", "llmd", "tiny", "--type=merge", "-p", json.dumps(lowered))
        launcher2 = naming.launcher_pod_name("tiny", 2)
        await llmd.wait(lambda: not llmd.pod(launcher2), 120, "world 2 drained and removed")
        removed_at = time.monotonic()
        drained = await asyncio.gather(*in_flight)

        # No request since: world 1 sleeps (same pods), then is released (its pods deleted).
        def asleep() -> bool:
            worlds = {world["index"]: world for world in llmd.status().get("worlds") or []}
            return worlds.get(1, {}).get("admission") == "parked"

        await llmd.wait(asleep, 60, "world 1 asleep")
        asleep_status = llmd.status()
        launcher1 = naming.launcher_pod_name("tiny", 1)
        launcher_asleep = llmd.pod(launcher1).get("metadata", {}).get("uid")
        await llmd.wait(lambda: not llmd.pod(launcher1), 60, "world 1 released")
        released = llmd.status()
        async with httpx.AsyncClient() as http:
            request = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
            still = await http.post(f"{llmd.openai_url()}/completions", json=request, timeout=60)
        spec_after = llmd.get()["spec"]
        events = {
            reason: llmd.events(reason)
            for reason in (
                "AutoscaledUp",
                "AutoscaledDown",
                "WorldDraining",
                "IdleSleep",
                "IdleRelease",
                "WorldRemoved",
            )
        }

    # Every request of the load completed, in full, on the three worlds.
    assert results and all(status == 200 for _, status in results), [s for _, s in results if s != 200]
    assert len({endpoint for endpoint, _ in results}) == 3
    # Worlds were added up to maxReplicas, never beyond it.
    assert max(seen_worlds) == 3
    scaling = scaled_up["autoscaling"]
    assert scaling["desiredReplicas"] == 3 and scaling["worlds"] == 3 and scaling["metric"] == "queueDepth"
    assert "queueDepth" in scaling["lastScaleReason"] and scaling["lastScaleTime"]
    assert events["AutoscaledUp"] and "queueDepth" in events["AutoscaledUp"][0]
    assert 'berth_llmdeployment_desired_worlds{name="tiny",namespace="default"} 3.0' in exported
    assert 'berth_llmdeployment_queue_depth{name="tiny",namespace="default"}' in exported
    # The scale-down drained world 2: every request in flight there ended in full before its pod went.
    assert all(status == 200 and tokens == DRAINED_TOKENS for status, tokens, _ in drained), drained
    assert max(finished for _, _, finished in drained) <= removed_at
    assert "maxReplicas 2: 3 -> 2 world(s)" in events["AutoscaledDown"][0]
    assert any(message.startswith("world 2: draining") for message in events["WorldDraining"])
    # Asleep in the same pods, the tier in status; then released.
    assert asleep_status["autoscaling"]["asleepWorlds"] == [1] and events["IdleSleep"]
    tiers = {world["index"]: world.get("tier") for world in asleep_status["worlds"]}
    assert tiers == {0: "awake", 1: "asleep"}
    assert launcher_asleep
    assert released["autoscaling"]["worlds"] == 1 and released["autoscaling"]["released"] is True
    assert events["IdleRelease"] and len(events["WorldRemoved"]) == 2
    assert still.status_code == 200, still.text
    # The operator never wrote the spec (GitOps-safe): replicas is still the starting point.
    spec_before["autoscaling"]["maxReplicas"] = 2  # the test's own patch
    assert spec_after == spec_before and spec_after["replicas"] == 1


SCALE_DOWN_WINDOW = 12  # scaleDown.stabilizationWindowSeconds: test-sized (the default is 300)


def scaling_status(change: Change) -> dict:
    return (change.object.get("status") or {}).get("autoscaling") or {}


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_load_gone_scales_down_only_after_the_stabilization_window_and_never_flaps(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    """Two worlds (replicas 2 of min 1, max 2) under a load that pauses and comes back within the
    scale-down's stabilization window, then stops: while the pause lasts the metric asks for one
    world and the count stays 2; after the stop it drops to 1 once, no sooner than the window
    after the last poll that saw the load. Read from the status the operator wrote, in the
    order the API server took it (its watch): desiredReplicas is 2, 2, ... then 1 for good."""
    target = 1
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 2,
        "metric": "queueDepth",
        "target": target,
        "windowSeconds": 2,
        "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW},
    }
    manifest = e2e.tiny_cpu_example(
        models, replicas=2, health=e2e.FAST_HEALTH, engineArgs=["--max-num-seqs=1"], autoscaling=autoscaling
    )
    manifest["spec"]["model"]["name"] = "tiny"
    results: list[tuple[str, int]] = []
    path = f"/apis/berth.dev/v1alpha1/namespaces/{cluster.namespace}/llmdeployments"

    def decision(change: Change) -> bool:
        return change.resource == "llmdeployments" and "desiredReplicas" in scaling_status(change)

    def loaded(change: Change) -> bool:
        # A poll that saw the load: with 2 serving worlds any ratio above 1/2 recommends 2 worlds.
        return decision(change) and (scaling_status(change).get("currentValue") or 0) > target / 2

    def quiet(change: Change) -> bool:
        return decision(change) and scaling_status(change).get("currentValue") == 0

    def held() -> bool:
        """True while no decision went below 2 worlds (fails the test at once otherwise)."""
        early = log.first(lambda c: decision(c) and scaling_status(c)["desiredReplicas"] < 2)
        assert early is None, f"scaled down while the load ran or paused: {scaling_status(early)}"
        return True

    def serving() -> list[str]:
        """The worlds the operator counts as serving (phase Ready): the load reaches each the
        moment it does, not a readiness probe later, as the Service's endpoints would."""
        ready = [
            world["launcherPod"]
            for world in llmd.status().get("worlds") or []
            if world.get("phase") == "Ready"
        ]
        return [ip for ip in (llmd.pod_status(pod).get("podIP") for pod in ready) if ip]

    async def under_load(until: Callable[[], Awaitable[Any]]) -> Any:
        """The load on until `until()` is done; then every client's last request ends."""
        stop = asyncio.Event()
        clients = asyncio.create_task(load(llmd, stop, results, serving))
        try:
            return await until()
        finally:
            stop.set()
            await asyncio.wait_for(clients, 120)

    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd, watching(cluster, path) as log:
        # The load from the start: it is there the moment both worlds serve.
        await under_load(
            lambda: llmd.wait(
                lambda: held() and len({endpoint for endpoint, _ in results}) == 2 and log.first(loaded),
                START_TIMEOUT,
                "both worlds Ready, serving the load",
            )
        )
        last_seen = [change for change in log.changes if loaded(change)][-1]
        paused = await log.wait_first(quiet, 60, "the pause seen (no request waiting)", after=last_seen)
        # The metric fell to 0 (one world would do) and the count held: the window is not over.
        assert scaling_status(paused)["desiredReplicas"] == 2, scaling_status(paused)
        again = await under_load(
            lambda: wait_for(lambda: held() and log.first(loaded, after=paused), 60, "the load seen again")
        )
        stopped = await log.wait_first(quiet, 60, "the stop seen", after=again)
        launcher1 = naming.launcher_pod_name("tiny", 1)
        await llmd.wait(
            lambda: not llmd.pod(launcher1), SCALE_DOWN_WINDOW + 60, "world 1 drained and removed"
        )
        async with httpx.AsyncClient() as http:
            request = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
            still = await http.post(f"{llmd.openai_url()}/completions", json=request, timeout=60)
        events = {
            reason: llmd.events(reason) for reason in ("AutoscaledUp", "AutoscaledDown", "WorldRemoved")
        }

    decisions = [change for change in log.changes if decision(change)]
    desired = [scaling_status(change)["desiredReplicas"] for change in decisions]
    down = next(change for change in decisions if scaling_status(change)["desiredReplicas"] == 1)
    last_loaded = [change for change in decisions if loaded(change) and change.seq < down.seq][-1]
    print(
        f"load away {again.at - last_seen.at:.1f}s (held at 2 worlds); scaled down "
        f"{down.at - last_loaded.at:.1f}s after the last poll that saw the load"
    )
    assert paused.seq < again.seq < stopped.seq < down.seq
    # Down once, for good: 2 until the window passed, then 1 (never back up).
    assert desired == [2] * desired.index(1) + [1] * (len(desired) - desired.index(1)), desired
    # The window counts from the last recommendation of 2 worlds: the poll that last saw the
    # load (its status written a moment after its poll, hence the second of slack).
    assert down.at - last_loaded.at >= SCALE_DOWN_WINDOW - 1, down.at - last_loaded.at
    assert len(events["AutoscaledDown"]) == 1 and "2 -> 1 world(s)" in events["AutoscaledDown"][0]
    assert "queueDepth" in events["AutoscaledDown"][0]
    assert events["AutoscaledUp"] == [] and len(events["WorldRemoved"]) == 1
    assert results and all(status == 200 for _, status in results), [s for _, s in results if s != 200]
    assert still.status_code == 200, still.text
