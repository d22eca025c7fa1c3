"""The decode-graph path (`pyexecutor/cuda_graphs.py`) on the CPU: its buckets, static buffers and
padding run with an eager forward in place of each replay (`emulate=True`), inside the real
engine loop. What only a GPU can show (the capture itself, replay speed) is `make gpu-check`'s."""

from __future__ import annotations

import pytest
import torch

from berth.engine import LLM, SamplingParams
from berth.engine.config import EngineConfig
from berth.engine.models.parallel import SINGLE
from berth.engine.pyexecutor.cuda_graphs import DecodeGraphs, capture_sizes
from berth.engine.pyexecutor.rank import decode_graphs_for, uses_decode_graphs
from berth.engine.pyexecutor.step_inputs import StepInputs
from tests.engine.conftest import kv_blocks_used, prompts_of_many_lengths


@pytest.mark.parametrize(
    ("max_batch_size", "sizes"),
    [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
     (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64])],
)  # fmt: skip
def test_buckets_are_powers_of_two_then_multiples_of_eight_up_to_the_batch(max_batch_size, sizes):
    assert capture_sizes(max_batch_size) == sizes


def test_a_step_pads_to_the_next_bucket_and_a_larger_one_runs_eagerly():
    graphs = DecodeGraphs(
        lambda *step: None, lambda: None, torch.device("cpu"),
        max_batch_size=20, max_model_len=64, block_size=16, emulate=True,
    )  # fmt: skip
    assert [graphs.bucket(n) for n in (1, 3, 5, 8, 9, 17, 20, 21)] == [1, 4, 8, 8, 16, 20, 20, None]


def test_graphs_only_on_a_gpu_unless_eager_is_enforced():
    config = EngineConfig(model="m")
    assert not uses_decode_graphs(config, torch.device("cpu"), SINGLE)
    assert uses_decode_graphs(config, torch.device("cuda:0"), SINGLE)
    assert not uses_decode_graphs(EngineConfig(model="m", enforce_eager=True), torch.device("cuda:0"), SINGLE)
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        EngineConfig(model="m", enforce_eager="yes")
    with pytest.raises(ValueError, match="need a CUDA device"):
        DecodeGraphs(
            lambda: None, lambda: None, torch.device("cpu"), max_batch_size=4, max_model_len=8, block_size=4
        )


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    # Different lengths: the batch shrinks as requests end, so steps land in several buckets.
    params = [
        SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=1) for i in range(5)
    ]
    outputs = llm.generate(prompts, params)
    return [
        (
            o.outputs[0].token_ids,
            [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        )
        for o in outputs
    ]


def test_replayed_decode_steps_give_the_eager_tokens_and_survive_sleep_and_wakeup(tiny_model):
    with LLM(
        tiny_model, executor="in-process", max_batch_size=6, kv_cache_blocks=32, max_model_len=96
    ) as llm:
        engine = llm.executor.engine
        runner = engine.model_runner
        prompts = prompts_of_many_lengths(llm.tokenizer, lengths=(3, 17, 1, 30, 9))
        eager = _greedy(llm, prompts)

        runner.use_decode_graphs(decode_graphs_for(runner, engine.config, emulate=True))
        runner.capture_decode_graphs()
        graphs = runner.decode_graphs
        assert graphs.captured and graphs.max_model_len == 96
        replayed = _greedy(llm, prompts)
        assert graphs.num_replays > 0
        for (eager_tokens, eager_logprobs), (tokens, logprobs) in zip(eager, replayed):
            assert tokens == eager_tokens
            assert logprobs == pytest.approx(eager_logprobs, abs=1e-4)
        assert kv_blocks_used(llm) == 0

        llm.sleep(level=1)
        assert not graphs.captured  # freed with the memory a sleep releases
        llm.wake_up()
        assert graphs.captured  # captured again against the reallocated KV cache
        before = graphs.num_replays
        assert [tokens for tokens, _ in _greedy(llm, prompts)] == [tokens for tokens, _ in eager]
        assert graphs.num_replays > before


def _decode_step(slots: list[int], block_size: int = 16) -> StepInputs:
    """A pure decode step of len(slots) sequences: sequence i is at position slots[i] % 16 of block
    slots[i] // 16, its only block."""
    n = len(slots)
    return StepInputs(
        input_ids=torch.arange(5, 5 + n),
        positions=torch.tensor([slot % block_size for slot in slots]),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor([slot % block_size + 1 for slot in slots], dtype=torch.int32),
        block_tables=torch.tensor([[slot // block_size] for slot in slots], dtype=torch.int32),
        logits_indices=torch.arange(n),
        num_prefills=0,
        max_query_len=1,
        max_seq_len=max(slot % block_size + 1 for slot in slots),
    )


def test_padding_rows_never_write_the_kv_cache(tiny_model):
    """4 sequences, then 3 padded to the same bucket of 4: the spare row (holding the 4th
    sequence's token from the step before) writes nothing, and the logits of the real rows are
    the eager forward's."""
    with LLM(
        tiny_model, executor="in-process", max_batch_size=4, kv_cache_blocks=16, max_model_len=64
    ) as llm:
        engine = llm.executor.engine
        runner = engine.model_runner
        runner.kv_cache.kv_caches.copy_(torch.randn(runner.kv_cache.shape))
        eager = runner.run(_decode_step([16 * 2 + 3, 16 * 5, 16 * 7 + 9]))
        runner.use_decode_graphs(decode_graphs_for(runner, engine.config, emulate=True))
        runner.capture_decode_graphs()
        runner.run(_decode_step([16 * 2 + 3, 16 * 5, 16 * 7 + 9, 16 * 11 + 1]))
        before = runner.kv_cache.kv_caches.clone()
        replayed = runner.run(_decode_step([16 * 2 + 3, 16 * 5, 16 * 7 + 9]))
        assert runner.decode_graphs.num_replays == 2
        changed = (runner.kv_cache.kv_caches != before).flatten(3).any(-1)  # [layer, k|v, block, slot]
        written = {(block, slot) for _, _, block, slot in changed.nonzero().tolist()}
        assert written <= {(2, 3), (5, 0), (7, 9)}, f"the padding row wrote {written}"
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
