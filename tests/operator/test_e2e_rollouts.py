"""Rollouts on real pods: the operator, the cluster's controllers and the test kubelet running
every rendered command (tests/support/e2e.py), two worlds of one rank each.

`spec.sleep` puts both worlds to sleep in their processes (Argo CD: Suspended, out of the
Service) and wakes them (Healthy, the same processes). `kubectl scale` to 1 drains world 1: a
streamed request in flight there ends in full before its pods go. A sleep schedule (the
operator's clock shifted to just before its times) parks the world at its time and wakes it at
the next, in the same engine rank: Healthy in Argo CD while asleep on schedule.

A spec change that needs new pods drains world 0 (its launcher parks, then ends with exit 0),
replaces its pods, and takes world 1 only once the new world 0 is Ready: never both out of
service (from the statuses recorded all along); both end on new pods that serve.
An in-place weight swap keeps every pod and process and serves the new weights (transformers'
greedy tokens on the new checkpoint). A swap onto weights whose logits are not finite fails its
wakeup's check on world 0: the engine refuses to serve them, the world restarts onto them and
fails again, the rollout stops there with the reason in status and Events (Argo CD: Degraded),
and world 1 is never taken: the same pods, still serving the weights it had.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from berth.engine.models.tiny_model import make_tiny_model
from berth.operator import naming
from tests.engine.conftest import hf_greedy, poisoned_copy
from tests.support import e2e
from tests.support.argocd_health import argocd_health
from tests.support.cluster import Cluster, sampling
from tests.support.kubelet import Kubelet
from tests.support.operator_runner import ShiftedClock

HEALTH = e2e.FAST_HEALTH
START_TIMEOUT = 150.0
PROMPT, MAX_TOKENS = "the quick brown fox", 8


def greedy_text(model: Path) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokens, _ = hf_greedy(hf, tokenizer(PROMPT)["input_ids"], MAX_TOKENS)
    return tokenizer.decode(tokens)


def engine_ranks(
    kubelet: Kubelet, pods: tuple[str, ...] = ("tiny-w0-0", "tiny-w1-0")
) -> dict[str, list[int]]:
    """Per worker pod, the PIDs of the engine's rank (mpirun's, under the pod's sshd)."""
    ranks = {}
    for name in pods:
        pids = []
        for pid in kubelet.processes(name):
            try:
                if "berth.engine.executor.worker" in " ".join(psutil.Process(pid).cmdline()):
                    pids.append(pid)
            except psutil.NoSuchProcess:
                continue
        ranks[name] = pids
    return ranks


async def answer(llmd: e2e.Deployed, index: int) -> str:
    """World `index`'s answer, from its launcher pod's IP."""
    ip = llmd.pod_status(naming.launcher_pod_name("tiny", index))["podIP"]
    request = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    async with httpx.AsyncClient() as client:
        reply = await client.post(
            f"http://{ip}:{naming.ENGINE_PORT}/v1/completions", json=request, timeout=60
        )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_in_place_swaps_on_real_pods_and_weights_that_fail_their_check_stop_the_rollout(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    second = e2e.readable(make_tiny_model(models.parent / "second", seed=1))  # the same shapes
    e2e.readable(poisoned_copy(second, models.parent / "poisoned"))
    manifest = e2e.tiny_cpu_example(
        models, replicas=2, health=HEALTH, rollout={"inPlaceWeightSwap": True, "drainTimeoutSeconds": 30}
    )
    manifest["spec"]["model"]["name"] = "tiny"
    mount = manifest["spec"]["model"]["volume"]["mountPath"]
    launchers = [naming.launcher_pod_name("tiny", index) for index in (0, 1)]

    async def patch_model(path: str) -> None:
        patch = {"spec": {"model": {"path": path}}}
        await cluster.kubectl("patch", "llmd", "tiny", "--type=merge", "-p", yaml.safe_dump(patch))

    def pod_uids() -> dict[str, str]:
        return {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.objects("v1/pods")}

    def both_ready() -> bool:
        worlds = llmd.status().get("worlds") or []
        return len(worlds) == 2 and all(world.get("phase") == "Ready" for world in worlds)

    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        await llmd.wait(both_ready, START_TIMEOUT, "both worlds Ready")
        before = await answer(llmd, 0)
        uids = pod_uids()
        assert set(launchers) <= set(uids)
        engines = engine_ranks(kubelet)
        assert all(len(pids) == 1 for pids in engines.values()), engines

        # 1. Other weights of the same shapes: each world sleeps and wakes onto them in place.
        await patch_model(f"{mount}/second")

        def swapped() -> bool:
            rollout = llmd.status().get("rollout") or {}
            worlds = llmd.status().get("worlds") or []
            return (
                bool(rollout.get("complete"))
                and rollout.get("done") == [0, 1]
                and both_ready()
                and all(
                    str(world.get("modelRevision", "")).startswith(f"{mount}/second@") for world in worlds
                )
            )

        await llmd.wait(swapped, START_TIMEOUT, "the swap rolled out")
        served = [await answer(llmd, index) for index in (0, 1)]
        assert pod_uids() == uids and llmd.events("WorldReplaced") == []
        assert engine_ranks(kubelet) == engines
        assert len(llmd.executions("launcher")) == 2  # no launcher ran again
        assert len(llmd.events("WeightsSwapped")) == 2

        # 2. Weights whose logits are not finite: world 0's wakeup fails its check, the world
        # restarts onto them and cannot serve them either; the rollout stops at world 0.
        await patch_model(f"{mount}/poisoned")
        await llmd.wait(lambda: (llmd.status().get("rollout") or {}).get("failed"), START_TIMEOUT, "stopped")
        deployment = llmd.get()
        status = deployment["status"]
        world0, world1 = llmd.world(0), llmd.world(1)
        world1_pods = {name: uid for name, uid in pod_uids().items() if name.startswith("tiny-w1")}
        still_serving = await answer(llmd, 1)

    expected_second = greedy_text(second)
    assert served == [expected_second, expected_second] and before != expected_second
    assert status["rollout"]["failed"]["world"] == 0, status["rollout"]
    assert "world 0" in status["rollout"]["failed"]["message"]
    assert world0["phase"] == "Failed" and "not finite" in world0.get("lastEngineError", ""), world0
    assert any("world 0" in message for message in llmd.events("RolloutFailed"))
    assert llmd.events("WeightSwapFailed") and "not finite" in llmd.events("WeightSwapFailed")[0]
    # World 1 was never taken: the same pods, ready, still on the weights it had.
    assert world1["phase"] == "Ready" and str(world1["modelRevision"]).startswith(f"{mount}/second@")
    assert world1_pods == {name: uid for name, uid in uids.items() if name.startswith("tiny-w1")}
    assert still_serving == expected_second
    assert argocd_health(deployment)["status"] == "Degraded"


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_a_rolling_change_on_real_pods_replaces_one_drained_world_at_a_time(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    manifest = e2e.tiny_cpu_example(models, replicas=2, health=HEALTH, rollout={"drainTimeoutSeconds": 30})
    manifest["spec"]["model"]["name"] = "tiny"
    launchers = [naming.launcher_pod_name("tiny", index) for index in (0, 1)]
    seen: list[list[bool]] = []

    def sample() -> None:
        worlds = [w for w in llmd.status().get("worlds") or [] if w.get("phase") != "Retiring"]
        seen.append([bool(w.get("ready")) for w in worlds])

    def launcher_uids() -> list[str | None]:
        return [llmd.pod(name).get("metadata", {}).get("uid") for name in launchers]

    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        await llmd.wait(lambda: llmd.status().get("readyReplicas") == 2, START_TIMEOUT, "both worlds Ready")
        before = await answer(llmd, 0)
        old = launcher_uids()
        async with sampling(sample, 0.02):
            patch = {"spec": {"env": [{"name": "BERTH_ROLLOUT_TEST", "value": "2"}]}}
            await cluster.kubectl("patch", "llmd", "tiny", "--type=merge", "-p", yaml.safe_dump(patch))

            def rolled_out() -> bool:
                rollout = llmd.status().get("rollout") or {}
                uids = launcher_uids()
                return (
                    bool(rollout.get("complete"))
                    and rollout.get("done") == [0, 1]
                    and llmd.status().get("readyReplicas") == 2
                    and all(uid not in (None, *old) for uid in uids)
                )

            await llmd.wait(rolled_out, START_TIMEOUT, "the rollout complete")
        after = [await answer(llmd, index) for index in (0, 1)]
        launcher_runs = llmd.executions("launcher")

    assert after == [before, before]
    # At most one world out of service at any time, and each was taken in turn.
    assert all(ready.count(False) <= 1 for ready in seen if len(ready) == 2), [
        ready for ready in seen if ready.count(False) > 1
    ]
    assert [False, True] in seen and [True, False] in seen
    assert sorted(llmd.events("WorldReplaced")) == [
        "world 0 replaced: its launcher pod spec changed",
        "world 1 replaced: its launcher pod spec changed",
    ]
    drained = [m for m in llmd.events("WorldAsleep") if m.endswith("(rollout)")]
    assert len(drained) == 2, drained
    # Each old launcher ran `berth launch` to its end: parked by the drain, then SIGTERM, exit 0.
    assert len(launcher_runs) == 4
    assert [run.exit_code for run in launcher_runs[:2]] == [0, 0], launcher_runs[:2]


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_sleep_wake_and_a_scale_down_that_drains_on_real_pods(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    manifest = e2e.tiny_cpu_example(models, replicas=2, health=HEALTH)
    manifest["spec"]["model"]["name"] = "tiny"
    launchers = [naming.launcher_pod_name("tiny", index) for index in (0, 1)]

    async def patch_spec(spec: dict) -> None:
        await cluster.kubectl("patch", "llmd", "tiny", "--type=merge", "-p", yaml.safe_dump({"spec": spec}))

    def health() -> str:
        return argocd_health(llmd.get())["status"] if llmd.get() else ""

    def phases() -> list[str]:
        return [world.get("phase", "") for world in llmd.status().get("worlds") or []]

    async def ready_code(index: int) -> int:
        ip = llmd.pod_status(launchers[index])["podIP"]
        async with httpx.AsyncClient() as client:
            return (await client.get(f"http://{ip}:{naming.ENGINE_PORT}/ready", timeout=5)).status_code

    async def streamed_on_world_1(started: asyncio.Event) -> tuple[list[dict], float]:
        """A long streamed completion on world 1: every chunk, and when the last one came."""
        ip = llmd.pod_status(launchers[1])["podIP"]
        request = {"model": "tiny", "prompt": "hello", "max_tokens": 900, "ignore_eos": True, "stream": True}
        chunks = []
        async with httpx.AsyncClient() as client:
            url = f"http://{ip}:{naming.ENGINE_PORT}/v1/completions"
            async with client.stream("POST", url, json=request, timeout=120) as reply:
                assert reply.status_code == 200
                async for line in reply.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[len("data: ") :]))
                        started.set()
        return chunks, time.monotonic()

    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        await llmd.wait(lambda: health() == "Healthy", START_TIMEOUT, "Healthy")
        before = await answer(llmd, 0)
        engines = engine_ranks(kubelet)
        assert all(len(pids) == 1 for pids in engines.values()), engines

        await patch_spec({"sleep": {"sleeping": True, "level": 1}})
        await llmd.wait(lambda: health() == "Suspended", START_TIMEOUT, "Suspended")
        asleep = llmd.status()
        asleep_ready = [await ready_code(index) for index in (0, 1)]
        await llmd.wait(lambda: not llmd.endpoints(), 30, "both worlds out of the Service")

        await patch_spec({"sleep": {"sleeping": False}})
        await llmd.wait(lambda: health() == "Healthy", START_TIMEOUT, "Healthy after the wakeup")
        awake = [await answer(llmd, index) for index in (0, 1)]
        woken_engines = engine_ranks(kubelet)

        started = asyncio.Event()
        stream = asyncio.ensure_future(streamed_on_world_1(started))
        await asyncio.wait_for(started.wait(), 30)
        await cluster.kubectl("scale", "llmd/tiny", "--replicas=1")
        scaled = time.monotonic()
        gone_at: list[float] = []

        def world_1_gone() -> bool:
            if not gone_at and not llmd.pod(launchers[1]):
                gone_at.append(time.monotonic())
            return bool(gone_at) and phases() == ["Ready"]

        chunks, ended = await asyncio.wait_for(stream, 120)
        await llmd.wait(world_1_gone, 60, "world 1 removed")
        pods = sorted(pod["metadata"]["name"] for pod in cluster.objects("v1/pods"))

    assert asleep["phase"] == "Sleeping" and [w["admission"] for w in asleep["worlds"]] == ["parked"] * 2
    assert asleep_ready == [503, 503]
    assert awake == [before, before] and woken_engines == engines  # woken in the same processes
    # The streamed request was in flight when the scale-down came, and ended in full first.
    assert scaled < ended <= gone_at[0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for chunk in chunks if chunk["choices"][0]["text"]) >= 1
    assert llmd.events("WorldRemoved") == ["world 1 removed: replicas is 1"]
    assert len(llmd.events("WorldDraining")) == 1
    assert pods == ["tiny-w0-0", "tiny-w0-launcher"]


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_a_sleep_schedule_parks_and_wakes_a_real_world_at_its_times(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    clock = ShiftedClock()
    night = dt.datetime(2026, 6, 1, 20, 0, tzinfo=dt.timezone.utc)  # 22:00 in Berlin (CEST)
    morning = dt.datetime(2026, 6, 2, 4, 0, tzinfo=dt.timezone.utc)
    schedules = [
        {"name": "night", "cron": "0 22 * * *", "timezone": "Europe/Berlin", "action": "Sleep", "level": 1},
        {"name": "morning", "cron": "0 6 * * *", "timezone": "Europe/Berlin", "action": "Wake"},
    ]
    manifest = e2e.tiny_cpu_example(models, health=HEALTH)
    manifest["spec"]["model"]["name"] = "tiny"
    clock.set(night - dt.timedelta(hours=1))

    def condition(kind: str) -> str:
        return llmd.condition(kind).get("status", "")

    async with e2e.deployed(cluster, kubelet, manifest, tmp_path, clock=clock) as llmd:
        await llmd.wait(lambda: llmd.world().get("phase") == "Ready", START_TIMEOUT, "the world Ready")
        before = await answer(llmd, 0)
        (engine,) = engine_ranks(kubelet, ("tiny-w0-0",))["tiny-w0-0"]
        clock.set(night - dt.timedelta(seconds=3))
        patch = {"spec": {"sleepSchedules": schedules}}
        await cluster.kubectl("patch", "llmd", "tiny", "--type=merge", "-p", yaml.safe_dump(patch))
        await llmd.wait(lambda: llmd.world().get("admission") == "parked", START_TIMEOUT, "parked at night")
        await llmd.wait(lambda: condition("Sleeping") == "True", 30, "Sleeping")
        asleep = llmd.get()

        clock.set(morning - dt.timedelta(seconds=3))
        await llmd.wait(lambda: condition("Ready") == "True", START_TIMEOUT, "awake in the morning")
        after = await answer(llmd, 0)
        ranks = engine_ranks(kubelet, ("tiny-w0-0",))["tiny-w0-0"]

    fired = asleep["status"]["sleepSchedule"]["lastFiring"]
    assert (fired["schedule"], fired["time"]) == ("night", "2026-06-01T20:00:00.000000Z")
    assert argocd_health(asleep)["status"] == "Healthy"  # asleep as planned
    assert "by schedule night" in argocd_health(asleep)["message"]
    assert after == before and ranks == [engine]  # woken in the same engine process
    assert len(llmd.events("WorldAsleep")) == 1 and len(llmd.events("WorldAwake")) == 1
