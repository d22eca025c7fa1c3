"""Disaggregated prefill and decode on real pods (tests/support/e2e.py): `kubectl apply` of the
CPU example with `spec.disaggregation` (one context world, one generation world, one rank each),
the real operator, the cluster's controllers and the test kubelet running every rendered command.

Asserted: each world's launcher runs `berth launch` with its pool's `--role` (the context world's
rank, in its worker pod, serves its KV cache on :8003), the router pod runs `berth serve --route`
over both launchers' stable names and is the Service's only endpoint; a completion sent there,
plain and streamed, is answered by the generation world from the KV cache the context world's
rank handed over (the router says so in its log; a failed pull would fail the request), and
equals transformers' greedy tokens. The KV handle names the context rank's worker pod by its
stable name, which the generation rank in another pod resolves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from berth.operator import naming, render
from berth.operator.crd_model import parse_spec
from tests.engine.conftest import hf_greedy
from tests.support import e2e
from tests.support.cluster import Cluster
from tests.support.kubelet import Kubelet

START_TIMEOUT = 120.0
PROMPT, MAX_TOKENS = "the quick brown fox", 12
POOLS = {"context": {"replicas": 1}, "generation": {"replicas": 1}}


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


async def test_a_disaggregated_deployment_answers_through_its_router_as_one_engine_would(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    manifest = e2e.tiny_cpu_example(models, health=e2e.FAST_HEALTH, disaggregation=POOLS)
    manifest["spec"]["model"]["name"] = "tiny"
    request = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        await llmd.wait(
            lambda: all(llmd.world(i).get("phase") in ("Ready", "Failed") for i in (0, 1)),
            START_TIMEOUT,
            "both worlds Ready",
        )
        assert [llmd.world(i)["phase"] for i in (0, 1)] == ["Ready", "Ready"], llmd.status().get("worlds")
        assert llmd.status()["replicas"] == 2
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

    # The Service's only endpoint is the router: no launcher takes clients' requests directly.
    (router_pod,) = [name for name, pod in pods.items() if name.startswith(naming.router_name("tiny") + "-")]
    assert router_ips == [pods[router_pod]["status"]["podIP"]]
    # Every command rendered for this deployment ran in its pod and became ready.
    rendered = rendered_pods(manifest, cluster.namespace)
    for prefix, command in rendered.items():
        matching = [run for run in runs if run.pod.startswith(prefix) and run.argv == command]
        assert any(run.ready for run in matching), (prefix, command, [(r.pod, r.argv) for r in runs])
    assert rendered["tiny-w0-launcher"][rendered["tiny-w0-launcher"].index("--role") + 1] == "context"
    assert rendered["tiny-w1-launcher"][rendered["tiny-w1-launcher"].index("--role") + 1] == "generation"
    # The generation world continued from the context world's KV cache, twice (plain, streamed).
    (router_run,) = [run for run in runs if run.pod == router_pod]
    assert router_run.log.read_text().count("done (handle: True)") == 2, router_run.log_tail()
    worker = naming.worker_host("tiny", cluster.namespace, 0, 0)
    assert kv_address.startswith(f"tcp://{worker}") and kv_address.endswith(f":{naming.KV_TRANSFER_PORT}")
    # The answers are one engine's: transformers' greedy tokens on the same checkpoint.
    tokenizer = AutoTokenizer.from_pretrained(models)
    model = AutoModelForCausalLM.from_pretrained(models, dtype=torch.float32).eval()
    expected, _ = hf_greedy(model, tokenizer(PROMPT)["input_ids"], MAX_TOKENS)
    assert plain.json()["choices"][0]["text"] == tokenizer.decode(expected)
    assert streamed == tokenizer.decode(expected)
