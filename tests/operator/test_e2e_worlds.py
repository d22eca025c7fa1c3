"""End to end through the real operator: `kubectl apply` of the CPU example (a tiny checkpoint,
two ranks), kopf against the emulator, the cluster's controllers, and the test kubelet running
every pod's rendered command in its own namespaces (tests/support/e2e.py).

Asserted: the worker pods run the image's sshd and become Ready by their probe; the launcher
pod runs its rendered `berth launch ...`, whose mpirun starts the two ranks in the worker pods
over ssh, and the world serves transformers' greedy tokens through the Service. A launcher that
cannot start fails with its command's exit code and error, the operator restarts the world,
gives up after the budget, and says why in status and Events, in the launcher's own words.
kill -9 of a rank in a worker pod ends the world; the operator restarts it whole and it serves
again, through the Service and through its frontend pod, which attaches to the new launcher
without being restarted. Deleting the LLMDeployment leaves no process, namespace or veth of any pod behind.

The renderer-coverage test runs every command the renderer emits (the launcher's `berth launch
... --attach-port`, the workers' sshd, the frontend's `berth serve --attach` to the launcher)
and says which did not become ready in the kubelet; each role carries its own pod template (an
init container writing into a template volume, env from the service account and an annotation),
and each running container shows its own role's template and no other's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from berth.operator import naming, render
from tests.engine.conftest import hf_greedy
from tests.support import e2e
from tests.support.cluster import Cluster
from tests.support.kubelet import NODE_NAME, Kubelet
from tests.support.pod_state import processes_in

# A tiny world: two CPU ranks, fast polls, a small restart budget (the launcher cannot start).
HEALTH = e2e.FAST_HEALTH
START_TIMEOUT = 120.0


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_the_rendered_pods_run_and_a_launcher_that_cannot_start_is_visible(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    manifest = e2e.tiny_cpu_example(models, tensorParallelSize=2, health=HEALTH)
    manifest["spec"]["model"]["path"] += "-missing"  # not on the volume: the launcher cannot start
    launcher = naming.launcher_pod_name("tiny", 0)
    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        # The workers: the rendered sshd, Ready by their tcpSocket probe on the ssh port.
        await llmd.wait(
            lambda: llmd.pod_ready("tiny-w0-0") and llmd.pod_ready("tiny-w0-1"), 60, "workers Ready"
        )
        workers = llmd.executions("worker")
        assert {e.pod for e in workers} >= {"tiny-w0-0", "tiny-w0-1"}
        assert all(e.argv == list(render.WORKER_COMMAND) for e in workers)

        # The launcher ran its rendered command, which refused a model it cannot find: the pod
        # failed with its exit code and its error; the world restarted once, then gave up.
        await llmd.wait(lambda: llmd.world().get("phase") == "Failed", START_TIMEOUT, "the world Failed")
        (first, *_) = llmd.executions("launcher")
        rendered = e2e.rendered_commands(manifest)["launcher"]
        assert first.argv == rendered and rendered[:2] == ["berth", "launch"]
        assert first.exit_code == 2
        error = f"berth launch: error: {manifest['spec']['model']['path']} is not a model directory"
        assert error in first.log_tail()
        terminated = llmd.terminated(launcher)
        assert terminated["exitCode"] == 2 and error in terminated["message"]
        world = llmd.world()
        assert world["lastRestartReason"] == "LauncherFailed" and world["restarts"] == 1
        # The crash history: when, why, the error's last line, the node it happened on.
        (record,) = world["recentRestarts"]
        assert record["time"] == world["lastRestartTime"] and record["reason"] == "LauncherFailed"
        assert record["node"] == NODE_NAME
        assert record["error"] and record["error"] in world["lastEngineError"].splitlines()[-1]
        assert (
            f"launcher pod {launcher}: container launcher exited with code 2 (Error)"
            in world["lastEngineError"]
        )
        assert error in world["lastEngineError"]
        degraded = llmd.condition("Degraded")
        assert degraded["status"] == "True" and error in degraded["message"]
        assert llmd.status()["phase"] == "Degraded"
        await llmd.wait(lambda: llmd.events("RestartBudgetExhausted"), 10, "the RestartBudgetExhausted Event")
        (restarted,) = llmd.events("WorldRestarted")
        assert error in restarted
        assert len(llmd.executions("launcher")) == 2  # the first launcher and its one restart

        # Every pod had its own network namespace; deleting the LLMDeployment removes them all.
        mount_namespaces = [
            c.mount_namespace for r in kubelet.pods.values() for c in r.containers if c.mount_namespace
        ]
        assert mount_namespaces and kubelet.netns_names()
        await llmd.delete()
        await llmd.wait(lambda: not cluster.objects("v1/pods"), 60, "every pod gone")
        await llmd.wait(lambda: not kubelet.netns_names(), 30, "every pod's network namespace removed")
        # The kubelet runs on a thread of its own: it forgets a pod just after the API's last word.
        await llmd.wait(lambda: not kubelet.pods, 30, "the kubelet forgot every pod")
    for namespace in mount_namespaces:
        assert processes_in(namespace) == [], f"processes of a deleted pod survived ({namespace})"


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_an_applied_world_serves_the_greedy_tokens_of_transformers(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    manifest = e2e.tiny_cpu_example(models, tensorParallelSize=2, health=HEALTH)
    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        await llmd.wait(lambda: llmd.world().get("phase") in ("Ready", "Failed"), START_TIMEOUT, "Ready")
        assert llmd.world()["phase"] == "Ready", llmd.world().get("lastEngineError")
        assert llmd.condition("Ready")["status"] == "True"
        # The Service routes to the launcher once the kubelet's own readiness probe passes too.
        await llmd.wait(llmd.endpoints, 30, "a ready endpoint")
        prompt = "the quick brown fox"
        request = {"model": manifest["spec"]["model"]["path"], "prompt": prompt, "max_tokens": 12}
        async with httpx.AsyncClient() as client:
            reply = await client.post(
                f"{llmd.openai_url()}/completions", json={**request, "temperature": 0}, timeout=60
            )
        assert reply.status_code == 200, reply.text
    tokenizer = AutoTokenizer.from_pretrained(models)
    model = AutoModelForCausalLM.from_pretrained(models, dtype=torch.float32).eval()
    expected, _ = hf_greedy(model, tokenizer(prompt)["input_ids"], 12)
    assert reply.json()["choices"][0]["text"] == tokenizer.decode(expected)


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_kill_9_of_a_rank_in_a_worker_pod_restarts_the_whole_world_and_its_frontend_serves_again(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    manifest = e2e.tiny_cpu_example(models, tensorParallelSize=2, frontends=1, health=HEALTH)
    launcher = naming.launcher_pod_name("tiny", 0)
    request = {"model": manifest["spec"]["model"]["path"], "prompt": "hi", "max_tokens": 4, "temperature": 0}

    async def answer(url: str) -> str:
        async with httpx.AsyncClient() as client:
            reply = await client.post(f"{url}/completions", json=request, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    def frontend() -> dict:
        """The frontend pod, once it is ready (it serves the world's engine from its own pod)."""
        (run,) = llmd.executions("frontend")
        return llmd.pod(run.pod) if llmd.pod_ready(run.pod) else {}

    async def frontend_answer() -> str:
        url = f"http://{frontend()['status']['podIP']}:{naming.ENGINE_PORT}/v1"
        return await answer(url)

    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        await llmd.wait(lambda: llmd.world().get("phase") == "Ready", START_TIMEOUT, "the world Ready")
        await llmd.wait(llmd.endpoints, 30, "a ready endpoint")
        before = await answer(llmd.openai_url())
        await llmd.wait(frontend, 60, "the frontend attached and ready")
        assert await frontend_answer() == before  # the world's engine answers through the frontend
        frontend_uid = frontend()["metadata"]["uid"]
        launcher_ip = llmd.pod_status(launcher)["podIP"]
        pods = {name: llmd.pod(name)["metadata"]["uid"] for name in (launcher, "tiny-w0-0", "tiny-w0-1")}

        # The rank in worker pod 1 (mpirun's, under that pod's sshd), killed -9.
        (rank,) = [
            pid
            for pid in kubelet.processes("tiny-w0-1")
            if "berth.engine.executor.worker" in " ".join(psutil.Process(pid).cmdline())
        ]
        os.kill(rank, signal.SIGKILL)

        # The engine is dead and says so: /health 503 (before the launcher exits with its world).
        async with httpx.AsyncClient() as client:

            async def health() -> httpx.Response | None:
                with contextlib.suppress(httpx.TransportError):
                    reply = await client.get(f"http://{launcher_ip}:{naming.ENGINE_PORT}/health", timeout=2)
                    return reply if reply.status_code == 503 else None
                return None

            dead = None
            deadline = asyncio.get_running_loop().time() + 20
            while dead is None and asyncio.get_running_loop().time() < deadline:
                dead = await health()
                await asyncio.sleep(0.1)
        assert dead is not None, "/health never answered 503"
        error = dead.json()["error"]  # hydra's verdict, as the worker pod's proxy reported it
        assert dead.json()["engine_dead"] is True and "a rank ended with exit code 9" in error, error
        assert "on tiny-w0-1.tiny-w0.default.svc" in error, error

        # The operator restarts the whole world: new pods for the launcher and both workers.
        await llmd.wait(lambda: llmd.world().get("restarts") == 1, 60, "the world restarted")
        await llmd.wait(
            lambda: all(
                llmd.pod(name).get("metadata", {}).get("uid") not in (None, uid) for name, uid in pods.items()
            ),
            60,
            "every pod of the world replaced",
        )
        await llmd.wait(lambda: llmd.world().get("phase") == "Ready", START_TIMEOUT, "the world Ready again")
        world = llmd.world()
        assert world["lastRestartReason"] in ("EngineDead", "LauncherFailed"), world
        (restarted,) = llmd.events("WorldRestarted")
        assert world["lastRestartReason"] in restarted or world["lastEngineError"] in restarted, restarted
        await llmd.wait(llmd.endpoints, 30, "a ready endpoint again")
        assert await answer(llmd.openai_url()) == before
        assert len(llmd.executions("launcher")) == 2
        # The frontend attached to the new launcher by itself: the same pod, never restarted.
        await llmd.wait(frontend, 60, "the frontend ready again")
        assert await frontend_answer() == before
        assert frontend()["metadata"]["uid"] == frontend_uid and len(llmd.executions("frontend")) == 1


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_a_stopped_rank_in_a_worker_pod_stalls_its_world_and_the_operator_restarts_it(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    """SIGSTOP of the rank in worker pod 1 while the world has a request: alive, silent. Rank 0's
    next collective times out (half the stall timeout), the launcher's /health says "stalled",
    and the operator restarts the whole world with reason Stalled, kept in its history."""
    manifest = e2e.tiny_cpu_example(
        models, tensorParallelSize=2, health=HEALTH, engineArgs=["--stall-timeout", "4"]
    )
    launcher = naming.launcher_pod_name("tiny", 0)
    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        await llmd.wait(lambda: llmd.world().get("phase") == "Ready", START_TIMEOUT, "the world Ready")
        launcher_url = f"http://{llmd.pod_status(launcher)['podIP']}:{naming.ENGINE_PORT}"
        (rank,) = [
            pid
            for pid in kubelet.processes("tiny-w0-1")
            if "berth.engine.executor.worker" in " ".join(psutil.Process(pid).cmdline())
        ]
        body = {
            "model": manifest["spec"]["model"]["path"],
            "prompt": "hi",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        url = f"{launcher_url}/v1/completions"
        try:
            async with httpx.AsyncClient(timeout=60) as http, http.stream("POST", url, json=body) as reply:
                assert reply.status_code == 200
                lines = []
                async for line in reply.aiter_lines():
                    if not lines:
                        os.kill(rank, signal.SIGSTOP)  # the world is stepping
                    lines.append(line)
            assert "stalled" in "".join(lines), lines[-3:]  # the stream ends with the reason
            await llmd.wait(lambda: llmd.world().get("restarts") == 1, 60, "the world restarted")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGCONT)
        await llmd.wait(lambda: llmd.world().get("phase") == "Ready", START_TIMEOUT, "the world Ready again")
        world = llmd.world()
        assert world["lastRestartReason"] == "Stalled", world
        assert world["lastEngineError"].startswith("EngineStalledError: stalled: a collective waited 2 s")
        assert [record["reason"] for record in world["recentRestarts"]] == ["Stalled"]
        (restarted,) = llmd.events("WorldRestarted")
        assert restarted.startswith("world 0 restarted (Stalled): EngineStalledError: stalled"), restarted


def role_template(role: str) -> dict:
    """A pod template whose every trace in a running pod names `role`."""
    return {
        "metadata": {"annotations": {"example.com/note": f"{role}-note"}},
        "spec": {
            "serviceAccountName": f"{role}-account",
            "imagePullSecrets": [{"name": f"{role}-pull"}],
            **({"nodeSelector": {"example.com/gpu": "true"}} if role == "worker" else {}),
            "volumes": [{"name": "mark", "emptyDir": {}}],
            "initContainers": [
                {
                    "name": "mark",
                    "image": "berth:test",
                    "command": ["sh", "-c", f"echo {role} > /mark/role"],
                    "volumeMounts": [{"name": "mark", "mountPath": "/mark"}],
                }
            ],
            "containers": [
                {
                    "name": role,
                    "env": [
                        {"name": "TEMPLATE_ROLE", "value": role},
                        {
                            "name": "POD_ACCOUNT",
                            "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}},
                        },
                        {
                            "name": "POD_NOTE",
                            "valueFrom": {
                                "fieldRef": {"fieldPath": "metadata.annotations['example.com/note']"}
                            },
                        },
                    ],
                    "volumeMounts": [{"name": "mark", "mountPath": "/mark", "readOnly": True}],
                    "resources": {"requests": {"example.com/rdma": "1"}, "limits": {"example.com/rdma": "1"}},
                }
            ],
        },
    }


@pytest.mark.slow  # a real world of pods on the test kubelet: engine starts, health polls and drains
async def test_every_command_the_renderer_emits_runs_and_becomes_ready(
    cluster: Cluster, kubelet: Kubelet, models: Path, tmp_path: Path
) -> None:
    manifest = e2e.tiny_cpu_example(models, tensorParallelSize=2, frontends=1, health=HEALTH)
    manifest["spec"]["model"]["revision"] = "2026-12-02"  # every optional flag in the command too
    # Each role's pod template: an init container, a volume, env, an annotation, a service account.
    for field, role in (("launcher", "launcher"), ("workers", "worker"), ("frontend", "frontend")):
        manifest["spec"][field] = {"template": role_template(role)}
    commands = e2e.rendered_commands(manifest)
    assert set(commands) == {"launcher", "worker", "frontend"}
    assert "--model-revision" in commands["launcher"]

    def settled() -> bool:
        # Each command became ready, or ran and keeps failing: ended at least twice (the world's
        # restart, a crash loop) with none of its runs still going.
        for role in commands:
            runs = llmd.executions(role)
            ready = any(e.ready for e in runs)
            failing = sum(e.exit_code is not None for e in runs) >= 2 and all(
                e.exit_code is not None for e in runs
            )
            if not (ready or failing):
                return False
        return True

    async with e2e.deployed(cluster, kubelet, manifest, tmp_path) as llmd:
        await llmd.wait(settled, START_TIMEOUT, "every rendered command ran")
        report = []
        for role, argv in sorted(commands.items()):
            runs = [e for e in llmd.executions(role) if e.argv == argv]
            if any(e.ready for e in runs):
                outcome = "ran and became ready"
            elif runs:
                ended = next(e for e in runs if e.exit_code is not None)
                last = (ended.log_tail().strip().splitlines() or ["(no output)"])[-1]
                outcome = f"ran and exited with code {ended.exit_code}: {last}"
            else:
                outcome = "never ran"
            report.append(f"{role}: {shlex.join(argv)}\n    {outcome}")
        await llmd.wait(lambda: llmd.world().get("modelRevisionLabel"), 30, "the engine's revision label")
        label = llmd.world()["modelRevisionLabel"]
        for role in commands:
            # The running container of each role's pod carries its own role's template, no other's.
            main = next(e for e in llmd.executions(role) if e.container == role and e.exit_code is None)
            init = [e for e in llmd.executions(role) if e.pod == main.pod and e.container == "mark"]
            assert [e.exit_code for e in init] == [0], f"{role}: the init container ran once, before the pod"
            environ = psutil.Process(main.pid).environ()
            if role == "worker":
                # sshd writes its process title over its environment: read what it was started with.
                runtime = kubelet.runtime(main.pod)
                environ = json.loads((runtime.root / "containers" / main.log.stem / "plan.json").read_text())[
                    "env"
                ]
            assert environ["TEMPLATE_ROLE"] == role
            assert environ["POD_ACCOUNT"] == f"{role}-account" and environ["POD_NOTE"] == f"{role}-note"
            # The init container wrote into the template's volume; the main container mounts it.
            assert Path(f"/proc/{main.pid}/root/mark/role").read_text().strip() == role
            pod = llmd.pod(main.pod)
            assert pod["spec"]["imagePullSecrets"] == [{"name": f"{role}-pull"}]
            assert pod["spec"]["containers"][0]["resources"]["limits"]["example.com/rdma"] == "1"
        assert llmd.pod("tiny-w0-0")["spec"]["nodeSelector"] == {"example.com/gpu": "true"}
        assert "nodeSelector" not in llmd.pod("tiny-w0-launcher")["spec"]
    print("\n".join(report))
    assert all(line.endswith("ran and became ready") for line in report), "\n" + "\n".join(report)
    assert label == "2026-12-02"  # `berth launch --model-revision`, as the operator reads it back
