"""Disaggregated prefill and decode on real pods (tests/support/e2e.py): `kubectl apply` of the
CPU example with `spec.disaggregation` (one context world of two ranks in two worker pods, one
generation world of one rank: the pools' layouts differ, so the generation rank reshards the KV
cache it pulls), the real operator, the cluster's controllers and the test kubelet running every
rendered command, behind the rendered NetworkPolicies (tests/support/network_policy.py).

Asserted: each world's launcher runs `berth launch` with its pool's `--role` and size (the
context world's rank 0, in its first worker pod, serves the world's KV cache on :8003), the
router pod runs `berth serve --route` over both launchers' stable names and is the Service's only
endpoint; a completion sent there, plain and streamed, is answered by the generation world from
the KV cache the context world handed over (the router says so in its log; a failed pull would
fail the request), and equals transformers' greedy tokens. The KV handle names the context rank
0's worker pod by its stable name, which the generation rank in another pod resolves.

Then the rules of worlds, per world of each pool: `spec.sleep` parks both worlds (the router,
with no ready server of a role, leaves the Service by its readiness probe) and wakes them; kill
-9 of the generation world's rank restarts that world whole while the context world and the
router stay, and the router answers again (it reaches each launcher by its stable name); a
rolling change (env) replaces each pool's world in turn, and the answers stay the same.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from berth.operator import naming, render
from berth.operator.crd_model import parse_spec
from tests.engine.conftest import hf_greedy
from tests.support import e2e
from tests.support.cluster import Cluster
from tests.support.kubelet import Kubelet
from tests.support.network_policy import Enforcer

START_TIMEOUT = 120.0
PROMPT, MAX_TOKENS = "the quick brown fox", 12
POOLS = {"context": {"replicas": 1, "tensorParallelSize": 2}, "generation": {"replicas": 1}}


def rendered_pods(manifest: dict[str, Any], namespace: str) -> dict[str, list[str]]:
    """Pod name (or the router Deployment's pod prefix) -> the command rendered for it."""
    name = manifest["metadata"]["name"]
    owner = render.Owner(name=name, namespace=namespace, uid="coverage")
    commands = {}
    for child in render.children(owner, parse_spec(manifest["spec"], name)):
        if child["kind"] == "Pod":
            commands[child["metadata"]["name"]] = child["spec"]["containers"][0]["command"]
        elif child["kind"] in ("StatefulSet", "Deployment"):
            command = child["spec"]["template"]["spec"]["containers"][0]["command"]
            commands[child["metadata"]["name"] + "-"] = command  # its pods' names start so
    return commands


def router_name(pods: dict[str, Any]) -> str:
    (name,) = [name for name in pods if name.startswith(naming.router_name("tiny") + "-")]
    return name


def engine_ranks(kubelet: Kubelet, pod: str) -> list[int]:
    """The engine rank processes in a worker pod (started by mpirun over that pod's sshd)."""
    return [
        pid
        for pid in kubelet.processes(pod)
        if "berth.engine.executor.worker" in " ".join(psutil.Process(pid).cmdline())
    ]


async def patch_spec(cluster: Cluster, spec: dict[str, Any]) -> None:
    await cluster.kubectl("patch", "llmd", "tiny", "--type=merge", "-p", json.dumps({"spec": spec}))


async def answer(url: str, request: dict[str, Any]) -> str:
    async with httpx.AsyncClient() as http:
        reply = await http.post(f"{url}/completions", json=request, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


async def answer_or_none(llmd: e2e.Deployed, request: dict[str, Any]) -> str | None:
    """An answer through the Service, or None while the router has no ready endpoint or the
    route is not whole yet (a restarted world's first connection)."""
    if not llmd.endpoints():
        return None
    try:
        async with httpx.AsyncClient() as http:
            reply = await http.post(f"{llmd.openai_url()}/completions", json=request, timeout=60)
    except httpx.HTTPError:
        return None
    return reply.json()["choices"][0]["text"] if reply.status_code == 200 else None


async def streamed_text(url: str, request: dict[str, Any]) -> str:
    text = ""
    async with (
        httpx.AsyncClient() as http,
        http.stream("POST", f"{url}/completions", json={**request, "stream": True}, timeout=60) as reply,
    ):
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[len("data: ") :])["choices"][0]["text"]
    return text


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_a_disaggregated_deployment_answers_through_its_router_as_one_engine_would(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    manifest = e2e.tiny_cpu_example(models, health=e2e.FAST_HEALTH, disaggregation=POOLS)
    manifest["spec"]["model"]["name"] = "tiny"
    request = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    # The rendered NetworkPolicies enforced: the generation rank's pull crosses worlds (:8003).
    async with (
        Enforcer(cluster, kubelet).running(),
        e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd,
    ):
        await llmd.wait(
            lambda: all(llmd.world(i).get("phase") in ("Ready", "Failed") for i in (0, 1)),
            START_TIMEOUT,
            "both worlds Ready",
        )
        assert [llmd.world(i)["phase"] for i in (0, 1)] == ["Ready", "Ready"], llmd.status().get("worlds")
        assert llmd.status()["replicas"] == 2
        assert [llmd.world(i).get("pool") for i in (0, 1)] == ["context", "generation"]
        router_ips = await llmd.wait(llmd.endpoints, 60, "the router ready in the Service")
        url = llmd.openai_url()
        async with httpx.AsyncClient() as http:
            plain = await http.post(f"{url}/completions", json=request, timeout=60)
        assert plain.status_code == 200, plain.text
        streamed = await streamed_text(url, request)
        # What the context world hands out: its rank's KV server, named as other pods reach it
        # (the first worker pod's stable name, not a loopback address).
        context_url = f"http://{llmd.pod_status('tiny-w0-launcher')['podIP']}:{naming.ENGINE_PORT}/v1"
        async with httpx.AsyncClient() as http:
            split = {"context_only": True, "pin_seconds": 1}
            first = await http.post(
                f"{context_url}/completions", json={**request, "disaggregated": split}, timeout=60
            )
        assert first.status_code == 200, first.text
        kv_address = first.json()["kv_handle"]["address"]
        runs = list(kubelet.executions)
        pods = {pod["metadata"]["name"]: pod for pod in cluster.objects("v1/pods")}
        router_pod = router_name(pods)
        (router_run,) = [run for run in runs if run.pod == router_pod]
        handovers = router_run.log.read_text().count("done (handle: True)")

        # Sleep applies to every world of both pools: the router, with no ready server of a role,
        # leaves the Service by its readiness probe; woken, it answers the same again.
        await patch_spec(cluster, {"sleep": {"sleeping": True, "level": 1}})
        await llmd.wait(lambda: llmd.status().get("phase") == "Sleeping", 60, "both worlds asleep")
        asleep = [llmd.world(i)["admission"] for i in (0, 1)]
        await llmd.wait(lambda: not llmd.endpoints(), 30, "the router out of the Service")
        await patch_spec(cluster, {"sleep": {"sleeping": False}})
        await llmd.wait(llmd.endpoints, 60, "the router back in the Service")
        woken = await answer(llmd.openai_url(), request)

        # kill -9 of the generation world's rank: the operator restarts that world whole (its
        # launcher and worker pod), the context world and the router stay, and answers come back.
        uids = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.objects("v1/pods")}
        (rank,) = engine_ranks(kubelet, "tiny-w1-0")
        os.kill(rank, signal.SIGKILL)
        await llmd.wait(lambda: llmd.world(1).get("restarts") == 1, 60, "world 1 restarted")
        await llmd.wait(lambda: llmd.world(1).get("phase") == "Ready", START_TIMEOUT, "world 1 Ready again")
        restarted = await llmd.wait(lambda: answer_or_none(llmd, request), 60, "an answer after the restart")
        now = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.objects("v1/pods")}
        replaced = {
            name: now.get(name) not in (None, uids[name]) for name in ("tiny-w1-launcher", "tiny-w1-0")
        }
        kept = {
            name: now.get(name) == uids[name]
            for name in ("tiny-w0-launcher", "tiny-w0-0", "tiny-w0-1", router_pod)
        }
        world_0_restarts = llmd.world(0).get("restarts", 0)

        # A rolling change replaces the worlds of both pools one at a time (drained, then new pods).
        launchers = ("tiny-w0-launcher", "tiny-w1-launcher")
        before_rollout = {name: llmd.pod(name)["metadata"]["uid"] for name in launchers}
        await patch_spec(cluster, {"env": [{"name": "BERTH_ROLLOUT_TEST", "value": "2"}]})

        def rolled_out() -> bool:
            rollout = llmd.status().get("rollout") or {}
            uids = [llmd.pod(name).get("metadata", {}).get("uid") for name in launchers]
            return (
                bool(rollout.get("complete"))
                and rollout.get("done") == [0, 1]
                and llmd.status().get("readyReplicas") == 2
                and all(uid not in (None, *before_rollout.values()) for uid in uids)
            )

        await llmd.wait(rolled_out, START_TIMEOUT, "the rollout complete")
        rolled = await llmd.wait(lambda: answer_or_none(llmd, request), 60, "an answer after the rollout")
        rollout_replacements = llmd.events("WorldReplaced")

    # The Service's only endpoint is the router: no launcher takes clients' requests directly.
    assert router_ips == [pods[router_pod]["status"]["podIP"]]
    # Every command rendered for this deployment ran in its pod and became ready.
    rendered = rendered_pods(manifest, cluster.namespace)
    for prefix, command in rendered.items():
        matching = [run for run in runs if run.pod.startswith(prefix) and run.argv == command]
        assert any(run.ready for run in matching), (prefix, command, [(r.pod, r.argv) for r in runs])
    assert rendered["tiny-w0-launcher"][rendered["tiny-w0-launcher"].index("--role") + 1] == "context"
    assert rendered["tiny-w1-launcher"][rendered["tiny-w1-launcher"].index("--role") + 1] == "generation"
    # Each pool's worlds have the pool's size: two ranks in two worker pods, then one.
    sizes = [
        command[command.index("--tensor-parallel-size") + 1]
        for command in rendered.values()
        if "launch" in command
    ]
    assert sizes == ["2", "1"] and {"tiny-w0-0", "tiny-w0-1", "tiny-w1-0"} <= set(pods)
    # The generation world continued from the context world's KV cache, twice (plain, streamed).
    assert handovers == 2, router_run.log_tail()
    worker = naming.worker_host("tiny", cluster.namespace, 0, 0)
    assert kv_address.startswith(f"tcp://{worker}") and kv_address.endswith(f":{naming.KV_TRANSFER_PORT}")
    # The answers are one engine's: transformers' greedy tokens on the same checkpoint.
    tokenizer = AutoTokenizer.from_pretrained(models)
    model = AutoModelForCausalLM.from_pretrained(models, dtype=torch.float32).eval()
    expected, _ = hf_greedy(model, tokenizer(PROMPT)["input_ids"], MAX_TOKENS)
    assert plain.json()["choices"][0]["text"] == tokenizer.decode(expected)
    assert streamed == tokenizer.decode(expected)
    # Asleep and woken, restarted: the rules of worlds, per world of each pool.
    assert asleep == ["parked", "parked"] and woken == tokenizer.decode(expected)
    assert all(replaced.values()) and all(kept.values()), (replaced, kept)
    assert world_0_restarts == 0 and restarted == tokenizer.decode(expected)
    assert rolled == tokenizer.decode(expected)
    assert {
        "world 0 replaced: its launcher pod spec changed",
        "world 1 replaced: its launcher pod spec changed",
    } <= set(rollout_replacements), rollout_replacements
