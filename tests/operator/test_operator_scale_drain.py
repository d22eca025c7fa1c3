"""Scale-down drains: `kubectl scale llmd/llama --replicas=1` (the scale subresource, as an HPA
uses it) sleeps worlds 1 and 2 in drain mode and removes them only once the requests in flight
there have finished; world 0 keeps serving throughout."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.operator_runner import running_operator

LLMD = "berth.dev/v1alpha1/llmdeployments"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"
# Per retiring world: more requests than its engine runs at once (the test servers' KV cache
# holds about one of these), so they are still running and queued when the scale-down lands.
REQUESTS_PER_WORLD = 8
MAX_TOKENS = 300


def status(cluster: Cluster) -> dict[str, Any]:
    return (cluster.get(LLMD, "llama") or {}).get("status") or {}


def events(cluster: Cluster, reason: str) -> list[str]:
    return [event["message"] for event in cluster.objects("v1/events") if event.get("reason") == reason]


async def complete(client: httpx.AsyncClient, url: str, model: str) -> tuple[dict[str, Any], float]:
    response = await client.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True},
        timeout=120,
    )
    return {"status": response.status_code, **response.json()}, time.monotonic()


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_scale_down_drains_the_removed_worlds_before_their_pods_go(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(replicas=3, frontends=0)
    doc["spec"]["health"] = {"intervalSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 3}
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))
    gone: dict[str, float] = {}

    async def watch_launchers() -> None:
        while True:
            for name in ("llama-w1-launcher", "llama-w2-launcher"):
                if name not in gone and cluster.get("v1/pods", name) is None:
                    gone[name] = time.monotonic()
            await asyncio.sleep(0.02)

    async with running_operator(cluster, fleet.resolve), httpx.AsyncClient() as client:
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "llama.yaml"))
        await wait_for(lambda: status(cluster).get("readyReplicas") == 3, START_TIMEOUT, "3 worlds Ready")
        keeper = fleet.for_pod("llama-w0-launcher")
        retiring = [fleet.for_pod(f"llama-w{index}-launcher") for index in (1, 2)]
        model = str(fleet.model)
        requests = [
            asyncio.ensure_future(complete(client, endpoint.url, model))
            for endpoint in retiring
            for _ in range(REQUESTS_PER_WORLD)
        ]

        async def busy() -> bool:
            states = [(await endpoint.get("/admin/state")).json() for endpoint in retiring]
            return all(state["num_running"] >= 1 and state["num_waiting"] >= 1 for state in states)

        await wait_for(busy, 30, "requests running and queued on worlds 1 and 2")
        watcher = asyncio.ensure_future(watch_launchers())
        try:
            await cluster.kubectl("scale", "llmd/llama", "--replicas=1")
            # While they drain, the retiring worlds are in status and world 0 still serves.
            await wait_for(
                lambda: (
                    [w["phase"] for w in status(cluster).get("worlds") or []]
                    == ["Ready", "Retiring", "Retiring"]
                ),
                30,
                "worlds 1 and 2 Retiring",
            )
            during = status(cluster)
            assert (await keeper.get("/ready")).status_code == 200
            answers = await asyncio.wait_for(asyncio.gather(*requests), 120)
            await wait_for(lambda: len(gone) == 2, 60, "the launchers of worlds 1 and 2 deleted")
        finally:
            watcher.cancel()
        await wait_for(
            lambda: cluster.names("apps/v1/statefulsets") == ["llama-w0"], 30, "worlds 1 and 2 pruned"
        )
        await wait_for(lambda: len(status(cluster).get("worlds") or []) == 1, 30, "one world in status")
        # The garbage collector takes the workers with their StatefulSets.
        pods = ["llama-w0-0", "llama-w0-1", "llama-w0-launcher"]
        await wait_for(lambda: sorted(cluster.names("v1/pods")) == pods, 30, "only world 0's pods")

    # Every request in flight on the removed worlds finished in full, before its world's pod went.
    for answer, _ in answers:
        assert answer["status"] == 200, answer
        (choice,) = answer["choices"]
        assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == MAX_TOKENS
    # Per world: one world's launcher may go once its own requests are done.
    for index in (1, 2):
        own = answers[(index - 1) * REQUESTS_PER_WORLD : index * REQUESTS_PER_WORLD]
        assert gone[f"llama-w{index}-launcher"] >= max(finished for _, finished in own)
    retiring_status = during["worlds"][1:]
    assert all("before removal" in world["message"] for world in retiring_status)
    progressing = next(c for c in during["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "WorldsRetiring"
    assert sorted(events(cluster, "WorldRemoved")) == [
        "world 1 removed: replicas is 1",
        "world 2 removed: replicas is 1",
    ]
    assert len(events(cluster, "WorldDraining")) == 2
    assert sorted(m.split(" in ")[0] for m in events(cluster, "WorldAsleep")) == [
        "world 1: sleep done",
        "world 2: sleep done",
    ]
    assert cluster.names("v1/configmaps") == ["llama-w0-hostfile"]
    # Drained already: the launchers went with the engine's shutdown margin, not their pods'
    # grace period (the drain timeout + that margin, for deletions such as an eviction).
    launchers = {"llama-w1-launcher", "llama-w2-launcher"}
    deletions = [
        request.data
        for request in list(cluster.emulator)
        if request.method.value.upper() == "DELETE" and request.resource is not None
        and request.resource.plural == "pods" and request.name in launchers
    ]  # fmt: skip
    assert deletions and all(body["gracePeriodSeconds"] == 30 for body in deletions), deletions
    final = status(cluster)
    assert final["replicas"] == 1 and final["worldsReady"] == "1/1" and final["phase"] == "Ready"
