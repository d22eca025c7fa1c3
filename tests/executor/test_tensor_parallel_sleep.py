"""Sleep and wakeup in a world of two real MPI ranks: rank 0 broadcasts each memory action
between steps, every rank runs it on its own shard and KV cache, and their outcomes come back
to rank 0. Every rank's process gives the memory back to the OS (its RSS, read from /proc),
greedy outputs after a wakeup (levels 1 and 2) are the ones before, and an in-place weight swap
serves the new checkpoint (equal to `transformers` on it) from the same ranks."""

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
from tests.executor.test_sleep_processes import fill_the_kv_pool
from tests.support.engine_processes import no_world_outlives

MiB = 1 << 20
KV_BLOCKS = 64  # of 16 tokens; 4 of the 8 KV heads per rank: 16 MiB of KV cache on each rank


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As in test_sleep_processes: what a sleep frees on each rank (16 MiB of KV cache, ~40 MiB
    of weights with the CPU GEMM's packed copies) stands far above a process's noise."""
    path = tmp_path_factory.mktemp("wide-llama")
    make_tiny_model(
        path, num_layers=8, hidden_size=512, intermediate_size=128, num_heads=8, num_kv_heads=8, init_std=0.02
    )
    return path


def test_every_rank_releases_and_restores_and_outputs_after_wakeup_are_the_ones_before(wide_model):
    params = SamplingParams(temperature=0, max_tokens=8)
    with LLM(
        wide_model, tensor_parallel_size=2, kv_cache_blocks=KV_BLOCKS, kv_block_size=16, max_batch_size=8
    ) as llm:
        prompts = prompts_of_many_lengths(llm.tokenizer, (1, 5, 17, 40))
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        pids = {rank: pid for rank, pid, _ in llm.executor.ranks}
        assert sorted(pids) == [0, 1]
        for level in (1, 2):
            fill_the_kv_pool(llm)
            resident = {rank: rss(pid) for rank, pid in pids.items()}
            slept = llm.sleep(level=level)
            assert slept.memory_before.kv_cache_bytes == 16 * MiB  # rank 0's: half the KV heads
            held = slept.memory_before.kv_cache_bytes + (
                slept.memory_before.weight_bytes if level == 2 else 0
            )
            for rank, pid in pids.items():  # the shards are alike: each rank held what rank 0 did
                freed = resident[rank] - rss(pid)
                assert freed >= 0.85 * held, (
                    f"level {level}: rank {rank} freed {freed / MiB:.0f} of {held / MiB:.0f} MiB"
                )
            assert slept.memory_after.kv_cache_bytes == 0
            woken = llm.wake_up()
            assert woken.memory_after.kv_cache_bytes == 16 * MiB
            after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            assert after == before, f"level {level}: the world answers otherwise after its wakeup"
            assert {rank: pid for rank, pid, _ in llm.executor.ranks} == pids  # the same ranks
    no_world_outlives()


def test_a_weight_swap_serves_the_new_checkpoint_on_every_rank(tiny_model, tmp_path):
    revision = make_tiny_model(tmp_path / "second", seed=1)  # the same shapes, other weights
    params = SamplingParams(temperature=0, max_tokens=12)
    with LLM(tiny_model, tensor_parallel_size=2, kv_cache_blocks=256, max_batch_size=16) as llm:
        prompts = prompts_of_many_lengths(llm.tokenizer, (1, 3, 9, 16, 33))
        previous = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        pids = {rank: pid for rank, pid, _ in llm.executor.ranks}
        llm.sleep(level=1)
        woken = llm.wake_up(revision)
        assert woken.model_revision.path == str(revision)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert {rank: pid for rank, pid, _ in llm.executor.ranks} == pids  # no rank restarted
        assert outputs != previous
    hf_model = AutoModelForCausalLM.from_pretrained(revision, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, outputs):
        # Both ranks' halves of every layer must be the new ones for this to hold.
        theirs, hf_logprobs = hf_greedy(hf_model, prompt, 12)
        check_against_reference(tokens, theirs, hf_logprobs)
    no_world_outlives()
