"""Sleep and wakeup with a real worker process: the memory a sleep releases really leaves the
process (its RSS, read from /proc, falls by what it held), and a wakeup with another
checkpoint serves that checkpoint (equal to `transformers` on it) from the same process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from berth.engine import LLM, SamplingParams
from berth.engine.models.tiny_model import make_tiny_model
from berth.engine.pyexecutor.sleep import resident_bytes as rss
from tests.engine.conftest import hf_greedy
from tests.engine.test_parity import check_against_reference, prompts_of_many_lengths
from tests.support.engine_processes import worker_pids

MiB = 1 << 20
KV_BLOCKS = 64  # of 16 tokens: 1024 tokens x 32 KiB = 32 MiB for the wide model below


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Big enough that what a sleep frees stands far above the noise of a Python process, small
    enough to fill its KV pool in a few seconds: 40 MiB of weights (8 layers of hidden 512 with
    a small MLP) and 32 KiB of KV cache per token (8 KV heads of 64 per layer)."""
    path = tmp_path_factory.mktemp("wide-llama")
    make_tiny_model(
        path, num_layers=8, hidden_size=512, intermediate_size=128, num_heads=8, num_kv_heads=8, init_std=0.02
    )
    return path


def fill_the_kv_pool(llm: LLM) -> None:
    """Prompts whose tokens write every block of the pool: the pool is resident, not just mapped."""
    limits = llm.limits
    count = limits.num_kv_blocks * limits.kv_block_size // 128
    prompts = [[7 + (i * 31 + j) % 400 for j in range(128)] for i in range(count)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    assert llm.executor.stats.kv_blocks_cached == limits.num_kv_blocks  # every block was written


@pytest.mark.slow  # sleep and wakeup across worker processes
def test_sleep_gives_the_kv_pool_and_at_level_2_the_weights_back_to_the_os(wide_model):
    with LLM(wide_model, kv_cache_blocks=KV_BLOCKS, kv_block_size=16, max_batch_size=8) as llm:
        pid = llm.executor.engine_pid
        assert pid in worker_pids()
        figures = {}
        for level in (1, 2):
            fill_the_kv_pool(llm)
            before = rss(pid)
            slept = llm.sleep(level=level)
            asleep = rss(pid)
            held = slept.memory_before.kv_cache_bytes + (
                slept.memory_before.weight_bytes if level == 2 else 0
            )
            figures[level] = (before, asleep, held)
            assert slept.memory_before.kv_cache_bytes == 32 * MiB
            assert slept.memory_before.weight_bytes > 38 * MiB  # with the CPU GEMM's packed copies, ~2x
            assert before - asleep >= 0.9 * held, (
                f"level {level}: RSS {before / MiB:.0f} -> {asleep / MiB:.0f} MiB, held {held / MiB:.0f} MiB"
            )
            llm.wake_up()
        print({level: tuple(f"{v / MiB:.0f} MiB" for v in f) for level, f in figures.items()})


@pytest.mark.slow  # sleep and wakeup across worker processes
def test_a_wakeup_with_another_checkpoint_serves_it_in_the_same_worker(tiny_model, tmp_path):
    revisions = [tmp_path / "second", tmp_path / "third"]
    for seed, path in enumerate(revisions, 1):
        make_tiny_model(path, seed=seed)  # the same shapes, other weights
    with LLM(tiny_model, kv_cache_blocks=256, max_batch_size=16) as llm:
        prompts = prompts_of_many_lengths(llm.tokenizer)
        params = SamplingParams(temperature=0, max_tokens=16)
        previous = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        pid, workers = llm.executor.engine_pid, worker_pids()
        served = {}
        for level, revision in zip((1, 2), revisions):
            hits = llm.executor.stats.prefix_cache_hits
            llm.sleep(level=level)
            woken = llm.wake_up(revision)
            assert woken.model_revision.path == str(revision) == llm.executor.model_revision.path
            outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            assert llm.executor.engine_pid == pid and worker_pids() == workers  # no process restarted
            # Every prompt was cached under the previous weights: none of it may be reused now.
            assert llm.executor.stats.prefix_cache_hits == hits
            assert outputs != previous
            served[revision], previous = outputs, outputs
    for revision, outputs in served.items():
        hf_model = AutoModelForCausalLM.from_pretrained(revision, dtype=torch.float32).eval()
        for prompt, tokens in zip(prompts, outputs):
            theirs, hf_logprobs = hf_greedy(hf_model, prompt, 16)
            check_against_reference(tokens, theirs, hf_logprobs)
