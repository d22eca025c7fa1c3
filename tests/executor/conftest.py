"""Executor tests run real worker processes; every one started here is gone when its test ends."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from berth.engine import LLM
from tests.support.engine_processes import wait_until, worker_pids

ENGINE_OPTIONS = {"max_batch_size": 32, "kv_cache_blocks": 256, "kv_block_size": 16}


@pytest.fixture(scope="module")
def proxy_llm(tiny_model: Path):
    """One proxy + worker engine shared by a module; tests must leave its KV pool empty."""
    with LLM(tiny_model, executor="proxy", **ENGINE_OPTIONS) as llm:
        yield llm


@pytest.fixture(autouse=True)
def no_worker_outlives_its_test():
    """Fails a test that leaves a worker behind (the module's shared engine, set up earlier, aside)
    and kills it."""
    before = set(worker_pids())
    yield
    wait_until(lambda: not set(worker_pids()) - before, timeout=10)
    leftovers = set(worker_pids()) - before
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"worker processes left running: {sorted(leftovers)}"
