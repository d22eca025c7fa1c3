"""Tensor-parallel worlds behind the OpenAI server, as real processes: `berth serve
--tensor-parallel-size N` (the server starts its world with mpich's mpiexec on this machine)
and `berth launch` (mpirun over a hostfile, through the launch agent, as a launcher pod runs
it). Their answers equal one rank's, which equal transformers'; a world ends as one (kill -9
of a rank under load, a host that vanishes, a rank that cannot load or restore its weights, the
server killed); nothing of a world outlives its test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from berth.engine import LLM, SamplingParams
from berth.engine.models import loader
from tests.engine.conftest import check_against_reference, hf_greedy, prompts_of_many_lengths
from tests.serve.server_process import ADMIN_TOKEN, ServerProcess
from tests.serve.test_serve_sleep import admin
from tests.support.engine_processes import no_world_outlives, wait_until, world_processes

SUPPORT = Path(__file__).resolve().parents[1] / "support"
MAX_NEW = 16
# 16 prompts of 1 to 64 tokens; 16 tokens a step chop the long ones into chunks, and 12 blocks of
# 16 slots cannot hold 8 running sequences: the scheduler must preempt.
PROMPT_LENGTHS = (1, 2, 3, 5, 7, 9, 13, 16, 17, 21, 31, 33, 45, 50, 60, 64)
ENGINE = {"max_num_tokens": 16, "kv_cache_blocks": 12, "kv_block_size": 16, "max_batch_size": 8}
ENGINE_ARGS = (
    "--max-num-tokens",
    "16",
    "--kv-blocks",
    "12",
    "--kv-block-size",
    "16",
    "--max-batch-size",
    "8",
)
STARTUP_TIMEOUT = 180  # python, torch and a model in every rank, on 2 busy cores


def one_rank_answers(model: Path) -> tuple[list[list[int]], list[tuple[str, int]]]:
    """The prompts, and the text and token count one in-process rank answers to each: the
    greedy tokens of transformers on the same checkpoint (checked here)."""
    with LLM(model, executor="in-process", **ENGINE) as llm:
        prompts = prompts_of_many_lengths(llm.tokenizer, PROMPT_LENGTHS)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=1))
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        theirs, hf_logprobs = hf_greedy(hf_model, prompt, MAX_NEW)
        check_against_reference(output.outputs[0].token_ids, theirs, hf_logprobs)
    return prompts, [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outputs]


@pytest.fixture(scope="module")
def llama_answers(tiny_model):
    return one_rank_answers(tiny_model)


@pytest.fixture(scope="module")
def tp3_answers(tiny_tp3):
    return one_rank_answers(tiny_tp3)


def complete(server: ServerProcess, prompt, max_tokens: int = MAX_NEW, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return server.post("/v1/completions", body, timeout=120)


def served_answers(server: ServerProcess, prompts) -> list[tuple[str, int]]:
    """Every prompt at once (so the engine batches, chunks and preempts)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: complete(server, p), prompts))
    answers = []
    for response in responses:
        assert response.status_code == 200, response.text
        body = response.json()
        answers.append((body["choices"][0]["text"], body["usage"]["completion_tokens"]))
    return answers


@pytest.fixture
def fake_ssh(tmp_path: Path) -> dict[str, str]:
    """The environment of a launcher whose `ssh` is tests/support/fake_ssh.py (it runs the remote
    command here), and where it logs how it was called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f'#!/bin/sh\nexec {sys.executable} {SUPPORT / "fake_ssh.py"} "$@"\n')
    ssh.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SSH_LOG": str(tmp_path / "ssh.log")}


def ssh_calls(env: dict[str, str]) -> list[list[str]]:
    log = Path(env["FAKE_SSH_LOG"])
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def kill_a_rank_under_load(server: ServerProcess, rank: int) -> list[httpx.Response]:
    """Kills rank `rank` while 8 long requests run; returns their answers, each within 10 s."""
    ranks = {entry["rank"]: entry["pid"] for entry in server.admin_state()["ranks"]}
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(complete, server, [5 + i] * (2 + i), 400, ignore_eos=True) for i in range(8)]
        assert wait_until(lambda: server.admin_state()["num_running"] > 0, 60), "the load never ran"
        os.kill(ranks[rank], signal.SIGKILL)
        killed_at = time.monotonic()
        answers = [future.result(timeout=15) for future in running]
    assert time.monotonic() - killed_at < 10
    return answers


def assert_dead(server: ServerProcess) -> None:
    response = server.get("/health")
    assert response.status_code == 503, response.text
    assert response.json()["engine_dead"] is True
    assert "MPI world of 2 ranks" in response.json()["error"]


# ---- berth serve --tensor-parallel-size --------------------------------------------------------------


@pytest.mark.slow  # `berth serve` of an MPI world
def test_a_served_world_answers_as_one_rank(tiny_model, llama_answers):
    prompts, expected = llama_answers
    server = ServerProcess(
        tiny_model, "--tensor-parallel-size", "2", *ENGINE_ARGS, startup_timeout=STARTUP_TIMEOUT
    )
    try:
        assert served_answers(server, prompts) == expected
        state = server.admin_state()
        assert state["tensor_parallel_size"] == 2 and [r["rank"] for r in state["ranks"]] == [0, 1]
        assert state["num_preemptions"] >= 1, "the workload was meant to force a preemption"
    finally:
        assert server.stop() == 0, server.output
    no_world_outlives(server.pid)


def test_kill_9_of_a_served_worlds_leader_fails_every_request_and_health_stays_503(tiny_model):
    server = ServerProcess(tiny_model, "-tp", "2", "--kv-blocks", "256", startup_timeout=STARTUP_TIMEOUT)
    try:
        answers = kill_a_rank_under_load(server, 0)
        assert {a.status_code for a in answers} == {503}
        assert {a.json()["error"]["code"] for a in answers} == {"engine_dead"}
        for _ in range(5):  # and it stays so
            assert_dead(server)
            time.sleep(0.3)
        no_world_outlives(server.pid)  # mpiexec and every rank are gone; the server still answers
        assert_dead(server)
    finally:
        assert server.stop() == 0, server.output


def test_a_killed_server_takes_its_world_with_it(tiny_model):
    server = ServerProcess(tiny_model, "-tp", "2", "--kv-blocks", "32", startup_timeout=STARTUP_TIMEOUT)
    try:
        assert len(world_processes(server.pid)) == 3  # mpiexec and two ranks
        os.kill(server.pid, signal.SIGKILL)
        no_world_outlives(server.pid, timeout=15)
    finally:
        server.stop()


# ---- berth launch ------------------------------------------------------------------------------------


@pytest.mark.slow  # `berth serve` of an MPI world
def test_launch_on_a_hostfile_naming_this_machine_answers_as_one_rank(tiny_tp3, tp3_answers, tmp_path):
    prompts, expected = tp3_answers
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost:1\n127.0.0.1:1\n{socket.gethostname()}:1\n")
    server = ServerProcess(
        tiny_tp3,
        "--hostfile", str(hostfile), "--tensor-parallel-size", "3", "--gpus-per-node", "0",
        "--launcher-host", "127.0.0.1", *ENGINE_ARGS,
        command="launch",
        startup_timeout=STARTUP_TIMEOUT,
    )  # fmt: skip
    try:
        assert served_answers(server, prompts) == expected
        assert server.admin_state()["num_preemptions"] >= 1
    finally:
        assert server.stop() == 0, server.output
    no_world_outlives(server.pid)


WORKER_HOSTS = ("w0-0.tiny-w0.default.svc", "w0-1.tiny-w0.default.svc")  # as the operator names them


def launch_on_two_hosts(
    model: Path, tmp_path: Path, env: dict[str, str], *options: str, **process_options
) -> ServerProcess:
    """`berth launch` of a TP=2 world on two worker hosts reached through the fake ssh."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{host}:1\n" for host in WORKER_HOSTS))
    return ServerProcess(
        model,
        "--hostfile", str(hostfile), "-tp", "2", "--launcher-host", "127.0.0.1", "--world-end-grace", "3",
        *options,
        command="launch",
        env=env,
        startup_timeout=STARTUP_TIMEOUT,
        **process_options,
    )  # fmt: skip


def test_launch_reaches_its_hosts_over_ssh_and_ends_with_its_world(
    tiny_model, llama_answers, tmp_path, fake_ssh
):
    key = tmp_path / "id_ed25519"
    key.write_text("not a key: the fake ssh never reads it\n")
    server = launch_on_two_hosts(tiny_model, tmp_path, fake_ssh, "--ssh-key", str(key), "--kv-blocks", "256")
    try:
        prompts, expected = llama_answers
        response = complete(server, prompts[5])
        assert response.json()["choices"][0]["text"] == expected[5][0]
        calls = ssh_calls(fake_ssh)
        for host in WORKER_HOSTS:
            mine = [call for call in calls if host in call]
            assert mine, f"nothing went to {host}: {calls}"
            for call in mine:  # the operator's key; worker pods' host keys change with every restart
                assert call[call.index("-i") + 1] == str(key)
                assert "StrictHostKeyChecking=no" in call and "BatchMode=yes" in call
            assert any(call[-1] == "true" for call in mine), "launch did not wait for the host to let it in"
            assert any("hydra_pmi_proxy" in " ".join(call) for call in mine), "mpirun did not start it"

        answers = kill_a_rank_under_load(server, 1)
        assert {a.status_code for a in answers} == {503}
        assert_dead(server)
        # The world ended: the launcher exits 1 (its grace over) and says why; nothing is left.
        assert server.wait(30) == 1, server.output
        assert "berth launch: the engine died: WorkerDiedError" in server.output
    finally:
        server.stop()
    no_world_outlives(server.pid)


def test_a_host_that_vanishes_ends_an_idle_world(tiny_model, tmp_path, fake_ssh):
    # A worker pod deleted (its node lost): its hydra proxy and its rank die together, so nobody
    # tells mpiexec, and no step is running for the other rank to notice. The launch agent's
    # connection to the host ends: that ends the world, and the launcher says which host.
    server = launch_on_two_hosts(tiny_model, tmp_path, fake_ssh, "--kv-blocks", "32")
    try:
        assert complete(server, [5, 6, 7]).status_code == 200
        follower = psutil.Process(next(r["pid"] for r in server.admin_state()["ranks"] if r["rank"] == 1))
        host_proxy = follower.parent()
        assert "hydra_pmi_proxy" in " ".join(host_proxy.cmdline())
        host_proxy.kill()
        follower.kill()
        assert wait_until(lambda: server.get("/health").status_code == 503, 15), "the world stayed up"
        assert assert_dead(server) is None
        assert server.wait(30) == 1, server.output
        assert "berth launch: the connection to w0-1.tiny-w0.default.svc ended (exit 137)" in server.output
    finally:
        server.stop()
    no_world_outlives(server.pid)


def test_one_rank_that_cannot_restore_its_weights_fails_the_world(tiny_model, tmp_path, fake_ssh):
    # Host w0-1's model volume is a copy of the checkpoint; while the world sleeps at level 2
    # (weights dropped), that copy loses its weights. Rank 0 reloads; rank 1 cannot.
    copy = tmp_path / "w0-1-volume"
    shutil.copytree(tiny_model, copy)
    env = {
        **fake_ssh,
        "FAKE_SSH_MOUNTS": f"{WORKER_HOSTS[1]}={tiny_model}={copy}",
        "BERTH_ADMIN_TOKEN": ADMIN_TOKEN,
    }
    server = launch_on_two_hosts(tiny_model, tmp_path, env, "--kv-blocks", "32", admin_token=ADMIN_TOKEN)
    try:
        assert complete(server, [5, 6, 7]).status_code == 200
        assert admin(server, "/admin/sleep", {"level": 2}).status_code == 200
        (copy / "model.safetensors").unlink()
        response = admin(server, "/admin/wakeup")
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead", (
            response.text
        )
        message = response.json()["error"]["message"]
        assert "wakeup failed: rank 1: FileNotFoundError" in message and "rank 0" not in message
        health = server.get("/health")
        assert health.status_code == 503 and "rank 1: FileNotFoundError" in health.json()["error"]
        assert server.wait(30) == 1, server.output  # the launcher ends with its world
    finally:
        server.stop()
    no_world_outlives(server.pid)


def test_a_rank_whose_host_lacks_a_shard_fails_the_launch_with_its_own_error(tiny_qwen2, tmp_path, fake_ssh):
    # Host w0-1's copy of the checkpoint lacks its last shard file (its volume differs).
    shards = loader.checkpoint_files(tiny_qwen2)
    stale = tmp_path / "stale-copy"
    shutil.copytree(tiny_qwen2, stale)
    (stale / shards[-1].name).unlink()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("w0-0.tiny-w0.default.svc:1\nw0-1.tiny-w0.default.svc:1\n")
    env = {**os.environ, **fake_ssh, "FAKE_SSH_MOUNTS": f"w0-1.tiny-w0.default.svc={tiny_qwen2}={stale}"}
    env = {k: v for k, v in env.items() if k != "BERTH_ENGINE_KEY"}
    launch = subprocess.Popen(
        [
            sys.executable, "-m", "berth", "launch", str(tiny_qwen2), "--hostfile", str(hostfile),
            "--tensor-parallel-size", "2", "--launcher-host", "127.0.0.1",
            "--host", "127.0.0.1", "--port", "0", "--kv-blocks", "16",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        _, stderr = launch.communicate(timeout=STARTUP_TIMEOUT)
    finally:
        launch.kill()
    assert launch.returncode != 0
    error = stderr.splitlines()[-1]
    assert error.startswith("berth launch: error: cannot start the engine: rank 1 of 2"), stderr
    assert "failed while loading the model: FileNotFoundError" in error and shards[-1].name in error
    no_world_outlives(launch.pid)  # the other rank did not stay behind
