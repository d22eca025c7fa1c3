"""The engine inside a memory cgroup, as in a pod with a memory limit: the KV pool is sized
under the limit (not from the host's free memory), survives load that writes every block, and
a limit too small for one full-length sequence fails at start with the numbers.

Against the old sizing (a fraction of the host's MemAvailable, capped only at what the batch
could use: 4 GiB for this model and batch) the first test's engine is OOM-killed half-way
through its load.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from berth.engine.models.tiny_model import make_tiny_model
from berth.engine.pyexecutor.memory_budget import host_limits
from berth.operator import render
from berth.operator.quantity import parse_quantity
from tests.serve.server_process import ServerProcess
from tests.support.e2e import CPU_EXAMPLE
from tests.support.engine_processes import pid_alive
from tests.support.memory_cgroup import memory_cgroup

# Keys and values of 16 layers x 8 KV heads x 64 dims in float32: 64 KiB of KV cache per token,
# so a pool of a few hundred MiB is written by a few thousand tokens of prefill (the layers are
# narrow: 20M parameters in all).
BYTES_PER_TOKEN = 2 * 16 * 8 * 64 * 4
MAX_MODEL_LEN = 4096  # one sequence: 256 MiB of KV cache
GiB = 1 << 30
# Well below the host's free memory, and small enough that filling the pool it leaves takes
# seconds: the server and its worker hold about 0.5 GiB before the pool.
LIMIT = 5 * GiB // 4


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose KV cache is large per token, with 65,536 positions (4 GiB of KV cache
    for one full-length sequence)."""
    path = tmp_path_factory.mktemp("long-context")
    make_tiny_model(
        path,
        num_layers=16,
        hidden_size=512,
        intermediate_size=128,
        num_heads=8,
        num_kv_heads=8,
        max_position_embeddings=65536,
    )
    return path


def worker_memory_limit() -> int:
    """The CPU example's worker memory limit: what the test engine gets, as that pod would."""
    spec = yaml.safe_load(CPU_EXAMPLE.read_text())["spec"]
    return int(parse_quantity(spec["resources"]["limits"]["memory"])[0])


def fraction_env() -> dict[str, str]:
    """What the operator puts in every engine pod (operator/render.py)."""
    return {"BERTH_KV_CACHE_MEMORY_FRACTION": render.KV_CACHE_MEMORY_FRACTION}


def host_available() -> int:
    (host,) = [limit for limit in host_limits() if limit.source == "host"]
    return host.available


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
def test_pool_sized_under_the_cgroup_limit_survives_load_that_writes_every_block(long_context_model):
    limit = LIMIT
    assert limit * 4 < host_available(), "the test needs a limit well below the host's free memory"
    with memory_cgroup(limit) as cgroup:
        server = ServerProcess(
            long_context_model,
            "--max-model-len", str(MAX_MODEL_LEN), "--max-batch-size", "16",
            env=fraction_env(),
            preexec_fn=cgroup.join,
            startup_timeout=120,
        )  # fmt: skip
        try:
            state = server.admin_state()
            assert server.engine_pid in cgroup.pids  # the worker is in the cgroup with the server
            num_blocks, block_size = state["kv_blocks_total"], 16
            pool_tokens = num_blocks * block_size

            # Load until every block has been written: distinct prompts (no prefix reuse), and a
            # pool hands out never-used blocks before freed ones, so prompts adding up to more
            # than the pool's tokens take every block at least once.
            rng = random.Random(0)
            prompts, total = [], 0
            while total < pool_tokens * 1.1:
                length = rng.randrange(300, 1200)
                prompts.append([rng.randrange(1, 500) for _ in range(length)])
                total += length

            def complete(prompt: list[int]) -> int:
                body = {"model": state["model"], "prompt": prompt, "max_tokens": 2}
                return server.post("/v1/completions", body, timeout=300).status_code

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                statuses = list(pool.map(complete, prompts))
            assert cgroup.oom_kills == 0 and pid_alive(server.engine_pid), server.output[-3000:]
            assert statuses == [200] * len(prompts), (statuses, server.output[-3000:])
            assert server.get("/health").status_code == 200

            after = server.admin_state()
            plan = after["kv_cache"]
            # Every page of the pool is resident now (and the worker lives: see above).
            assert after["resident_bytes"] >= plan["pool_bytes"] + after["weight_bytes"]
            # Sized from the cgroup, under it, with the operator's fraction.
            assert plan["limit_source"] == "cgroup" and plan["limit_bytes"] == limit
            assert plan["bytes_per_token"] == BYTES_PER_TOKEN and plan["dtype"] == "float32"
            assert plan["pool_bytes"] == num_blocks * BYTES_PER_TOKEN * block_size
            assert MAX_MODEL_LEN * BYTES_PER_TOKEN <= plan["pool_bytes"] < limit
            usable = plan["available_bytes"] - plan["activation_peak_bytes"] - plan["headroom_bytes"]
            assert plan["pool_bytes"] <= 0.9 * usable < plan["pool_bytes"] + plan["bytes_per_block"]
            assert plan["activation_peak_bytes"] > 0
            line = f"berth serve: KV cache: {num_blocks} blocks = "
            assert line in server.output and "GiB from cgroup" in server.output
        finally:
            server.stop()


def test_a_limit_too_small_for_one_full_length_sequence_fails_at_start(long_context_model):
    """At its full 65,536 positions one sequence needs 4 GiB of KV cache: more than the CPU
    example's worker limit holds."""
    limit = worker_memory_limit()
    with memory_cgroup(limit) as cgroup:
        command = [sys.executable, "-m", "berth", "serve", str(long_context_model), "--port", "0"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")} | fraction_env()
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=120, preexec_fn=cgroup.join, env=env
        )
        assert cgroup.oom_kills == 0
    assert done.returncode == 2, done.stderr[-3000:]
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith(
        "berth serve: error: cannot start the engine: not enough memory for one full-length "
        "sequence: it needs 4096 KV blocks (4.00 GiB)"
    ), message
    assert re.search(rf"the cgroup limit \(.*\) is {limit / GiB:.2f} GiB", message), message
    assert "lower max_model_len" in message
