"""Scale to zero and back on real pods (tests/support/e2e.py): one world of one rank on the tiny
model, `spec.autoscaling.idle.minAwake: 0`, so the operator runs the deployment's activator pod.

Idle, the world sleeps: the Service's only ready endpoint is the activator. Streaming requests
sent to the Service then are held, the demand reaches the operator over its long poll (the
health polls here are 3 s apart: the wake starts before the next one), the operator wakes
the world, and every held request is answered in full, its first token after the wake. Then
the world is released (its pods deleted); a request wakes the deployment again, from a cold
world start. The test prints each time to first token next to what it waits for: the wake time
the engine reports, and the cold start of the first world.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from berth.operator import naming
from tests.support import e2e
from tests.support.argocd_health import argocd_health
from tests.support.cluster import Cluster
from tests.support.kubelet import Kubelet

START_TIMEOUT = 150.0
HELD, MAX_TOKENS = 3, 16
# Polls seconds apart: only the activator's long poll can start a wake within a second.
HEALTH = {**e2e.FAST_HEALTH, "intervalSeconds": 3, "timeoutSeconds": 3}


async def streamed(url: str) -> tuple[float, str, int]:
    """One streaming completion through the Service: (seconds to the first token, text, status)."""
    request = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": MAX_TOKENS, "stream": True}
    started = time.monotonic()
    first: float | None = None
    text = ""
    async with (
        httpx.AsyncClient() as http,
        http.stream("POST", f"{url}/completions", json=request, timeout=120) as reply,
    ):
        if reply.status_code != 200:
            return 0.0, (await reply.aread()).decode(), reply.status_code
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[len("data: ") :])["choices"][0]["text"]
            if piece and first is None:
                first = time.monotonic() - started
            text += piece
    return first if first is not None else float("nan"), text, 200


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_requests_to_a_sleeping_or_released_deployment_wake_it_and_are_answered(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    idle = {"sleepAfterSeconds": 3, "minAwake": 0, "level": 1, "minWorlds": 0, "wakeTimeoutSeconds": 120}
    autoscaling = {"minReplicas": 1, "maxReplicas": 1, "target": 4, "windowSeconds": 0, "idle": idle}
    manifest = e2e.tiny_cpu_example(models, replicas=1, health=HEALTH, autoscaling=autoscaling)
    manifest["spec"]["model"]["name"] = "tiny"
    launcher = naming.launcher_pod_name("tiny", 0)

    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        applied = time.monotonic()
        await llmd.wait(lambda: llmd.world().get("phase") == "Ready", START_TIMEOUT, "world 0 Ready")
        cold_start = time.monotonic() - applied
        activator_ip = await llmd.wait(
            lambda: next(
                (
                    pod["status"]["podIP"]
                    for pod in cluster.objects("v1/pods")
                    if pod["metadata"]["name"].startswith("tiny-activator-")
                    and llmd.pod_ready(pod["metadata"]["name"])
                ),
                None,
            ),
            60,
            "the activator Ready",
        )
        # 1. No request: the world sleeps, the activator is the Service's only ready endpoint.
        await llmd.wait(lambda: llmd.world().get("admission") == "parked", 60, "world 0 asleep")
        await llmd.wait(lambda: llmd.endpoints() == [activator_ip], 30, "only the activator in the Service")
        asleep = llmd.status()
        asleep_health = argocd_health(llmd.get())
        pods_asleep = llmd.pod(launcher)["metadata"]["uid"]
        url = llmd.openai_url()
        held = [asyncio.ensure_future(streamed(url))]
        for _ in range(HELD - 1):
            await asyncio.sleep(0.2)
            held.append(asyncio.ensure_future(streamed(url)))
        waking_seen = await llmd.wait(lambda: llmd.events("Waking"), 30, "the operator waking world 0")
        from_asleep = await asyncio.wait_for(asyncio.gather(*held), 120)
        woke = llmd.events("WorldAwake")
        same_pod = llmd.pod(launcher)["metadata"]["uid"] == pods_asleep

        # 2. Released: after releaseAfterSeconds asleep the world's pods go; a request brings one back.
        patch = {"spec": {"autoscaling": {"idle": {"releaseAfterSeconds": 2}}}}
        await cluster.kubectl("patch", "llmd", "tiny", "--type=merge", "-p", json.dumps(patch))
        await llmd.wait(lambda: not llmd.pod(launcher), 90, "world 0 released")
        await llmd.wait(lambda: llmd.endpoints() == [activator_ip], 30, "only the activator in the Service")
        released = llmd.status()
        from_released = await asyncio.wait_for(streamed(llmd.openai_url()), 180)
        events = {
            reason: llmd.events(reason) for reason in ("IdleSleep", "IdleRelease", "IdleWake", "WorldRemoved")
        }
        activator_runs = [e for e in kubelet.executions if e.pod.startswith("tiny-activator-")]

    wake_seconds = float(re.search(r"wakeup done in ([0-9.]+)s", woke[0]).group(1))
    ttft_asleep = from_asleep[0][0]
    ttft_released = from_released[0]
    print(
        f"\nfrom asleep: time to first token {ttft_asleep * 1000:.0f} ms (the held requests woke the "
        f"world; health polls are {HEALTH['intervalSeconds']} s apart), the engine's wake "
        f"{wake_seconds * 1000:.0f} ms"
        f"\nfrom released: time to first token {ttft_released:.2f} s, a cold world start "
        f"{cold_start:.2f} s (ratio {ttft_released / cold_start:.2f}); released vs asleep: "
        f"{ttft_released / ttft_asleep:.0f}x"
    )
    # The activator pod ran the command the operator rendered for it, and became ready.
    rendered = e2e.rendered_commands(manifest)["activator"]
    assert any(run.argv == rendered and run.ready for run in activator_runs), activator_runs
    # Asleep: every held request answered in full, in the same pod, after one wake.
    assert asleep["autoscaling"]["asleepWorlds"] == [0] and asleep["worlds"][0]["tier"] == "asleep"
    assert all(status == 200 and text for _, text, status in from_asleep), from_asleep
    assert waking_seen and same_pod and len(woke) >= 1
    # Asleep for idleness is the plan: Argo CD shows it Healthy (not Suspended).
    assert asleep_health["status"] == "Healthy" and "autoscaling (idle)" in asleep_health["message"]
    # Released: its pods were deleted, and a new world answered the request.
    assert released["autoscaling"]["worlds"] == 0 and released["autoscaling"]["released"] is True
    assert released.get("worlds") in (None, [])
    assert from_released[2] == 200 and from_released[1], from_released
    assert events["IdleRelease"] and events["WorldRemoved"] and len(events["IdleWake"]) >= 2
