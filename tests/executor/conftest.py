"""Executor tests run real worker processes; every one started here is gone when its test ends."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from berth.engine import LLM
from tests.support.engine_processes import POSTPROCESS_MODULE, wait_until, worker_pids

ENGINE_OPTIONS = {"max_batch_size": 32, "kv_cache_blocks": 256, "kv_block_size": 16}


@pytest.fixture(scope="module")
def proxy_llm(tiny_model: Path):
    """One proxy + worker engine shared by a module; tests must leave its KV pool empty."""
    with LLM(tiny_model, executor="proxy", **ENGINE_OPTIONS) as llm:
        yield llm


def all_worker_pids() -> set[int]:
    return set(worker_pids()) | set(worker_pids(module=POSTPROCESS_MODULE))


@pytest.fixture(autouse=True)
def no_worker_outlives_its_test():
    """Fails a test that leaves a worker (an engine's or a postprocess worker) behind (the
    module's shared engine, set up earlier, aside) and kills it."""
    before = all_worker_pids()
    yield
    wait_until(lambda: not all_worker_pids() - before, timeout=10)
    leftovers = all_worker_pids() - before
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"worker processes left running: {sorted(leftovers)}"
