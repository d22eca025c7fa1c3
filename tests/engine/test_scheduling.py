"""The engine loop driven one turn at a time: queue policies, group admission, preemption,
budgets, and a bad request failing alone."""

from __future__ import annotations

import numpy as np
import pytest

from berth.engine.config import EngineConfig
from berth.engine.executor import GenerationRequest
from berth.engine.pyexecutor.py_executor import PyExecutor
from berth.engine.pyexecutor.sequence import Sequence, SequenceState
from berth.engine.pyexecutor.waiting_queue import FCFSWaitingQueue, PriorityWaitingQueue
from berth.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def make_engine(model, **options) -> PyExecutor:
    return PyExecutor.from_config(EngineConfig(model=str(model), **options))


def submit(engine: PyExecutor, request_id: int, prompt=(5, 6, 7), params=GREEDY, priority=0.5) -> None:
    request = GenerationRequest(list(prompt), params, priority=priority)
    request.request_id = request_id
    engine.request_queue.enqueue_request(request)


def run_to_completion(engine: PyExecutor, max_turns: int = 500) -> list:
    """Every response, in the order the engine emitted them."""
    responses = []
    for _ in range(max_turns):
        responses += engine.iterate()
        if not engine.scheduler.has_work() and engine.request_queue.empty():
            return responses
    raise AssertionError(f"the engine still has work after {max_turns} turns")


def finish_order(responses) -> list[int]:
    return [r.request_id for r in responses if r.finish_reason is not None]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", [1, 2, 3, 4, 5]), ("priority", [2, 4, 5, 3, 1])],
)
def test_queue_policy_decides_who_runs_first_under_contention(tiny_model, policy, expected):
    engine = make_engine(tiny_model, max_batch_size=1, kv_cache_blocks=16, scheduling_policy=policy)
    for request_id, priority in zip(range(1, 6), [0.1, 0.9, 0.5, 0.9, 0.9]):
        submit(engine, request_id, priority=priority)
    assert finish_order(run_to_completion(engine)) == expected
    assert engine.kv_cache.pool.num_used == 0


def request(priority: float) -> list[Sequence]:
    return [Sequence(0, 0, [1], GREEDY, priority=priority, max_tokens=1, arrival_time=0.0)]


@pytest.mark.parametrize("queue_type", [FCFSWaitingQueue, PriorityWaitingQueue])
def test_a_pushed_back_group_stays_ahead_of_later_peers(queue_type):
    queue = queue_type()
    a, b, c = request(0.5), request(0.5), request(0.5)
    queue.append(a)
    queue.append(b)
    assert queue.pop() is a
    queue.append(c)
    queue.prepend(a)  # preempted: back in line, but ahead of b and c
    assert [queue.pop() for _ in range(3)] == [a, b, c]


def test_priority_queue_puts_a_pushed_back_group_behind_higher_priorities():
    queue = PriorityWaitingQueue()
    low, high = request(0.2), request(0.8)
    queue.append(high)
    queue.prepend(low)
    assert list(queue) == [high, low]


def test_n_children_are_admitted_together_or_not_at_all(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=3, kv_cache_blocks=16)
    submit(engine, 1, params=SamplingParams(temperature=0, max_tokens=6))
    engine.iterate()
    submit(engine, 2, params=SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=3))
    engine.iterate()
    # Two free seats are not enough for three children: none of them may start.
    assert [r.request_id for r in engine.scheduler.running] == [1]
    responses = run_to_completion(engine)
    children = [r for r in responses if r.request_id == 2 and r.finish_reason]
    assert sorted(r.seq_index for r in children) == [0, 1, 2]
    assert finish_order(responses)[0] == 1


def test_token_budget_chunks_a_long_prompt(tiny_model):
    engine = make_engine(tiny_model, max_num_tokens=8, kv_cache_blocks=16)
    submit(engine, 1, prompt=range(3, 23))  # 20 tokens: chunks of 8, 8, 4
    engine.iterate()
    (sequence,) = engine.scheduler.running
    assert sequence.state is SequenceState.CONTEXT_IN_PROGRESS
    assert sequence.num_computed_tokens == 8
    engine.iterate()
    assert sequence.num_computed_tokens == 16
    engine.iterate()
    assert sequence.state is SequenceState.GENERATION_IN_PROGRESS
    assert sequence.num_output_tokens == 1
    run_to_completion(engine)


@pytest.mark.slow  # generates until the KV pool is exhausted and requests are preempted
def test_preempted_request_resumes_with_unchanged_output(tiny_model):
    params = SamplingParams(temperature=0, max_tokens=40)
    prompts = [list(range(3, 30)), list(range(40, 70))]
    alone = make_engine(tiny_model, kv_cache_blocks=32)
    for request_id, prompt in enumerate(prompts, 1):
        submit(alone, request_id, prompt=prompt, params=params)
    expected = {r.request_id: r.token_ids for r in run_to_completion(alone)}

    # 6 blocks of 16: both fit at first, but not both of their full lengths (each needs 5).
    tight = make_engine(tiny_model, kv_cache_blocks=6)
    for request_id, prompt in enumerate(prompts, 1):
        submit(tight, request_id, prompt=prompt, params=params)
    responses = run_to_completion(tight)
    assert tight.num_preemptions >= 1
    assert {r.request_id: r.token_ids for r in responses} == expected
    assert tight.kv_cache.pool.num_used == 0


def test_a_bad_request_fails_alone(tiny_model):
    engine = make_engine(tiny_model, kv_cache_blocks=16)
    vocab = engine.model_config.vocab_size
    submit(engine, 1)
    submit(engine, 2, prompt=[5, vocab + 3])
    submit(engine, 3)
    responses = run_to_completion(engine)
    (error,) = [r for r in responses if r.error]
    assert error.request_id == 2 and error.error.code == "invalid_request"
    assert f"token id {vocab + 3}" in str(error.error) and str(vocab) in str(error.error)
    assert sorted(finish_order(responses)) == [1, 3]


def test_a_request_that_can_never_fit_is_rejected_with_the_numbers(tiny_model):
    engine = make_engine(tiny_model, kv_cache_blocks=4, kv_block_size=16)
    submit(engine, 1, prompt=range(3, 13), params=SamplingParams(max_tokens=100))
    (response,) = run_to_completion(engine)
    assert response.error.code == "too_long"
    for number in ("needs 7 blocks", "16 tokens", "prompt 10", "max_tokens 100", "holds 4 blocks"):
        assert number in str(response.error)


def test_prompt_plus_max_tokens_beyond_the_model_length_is_rejected(tiny_model):
    engine = make_engine(tiny_model, max_model_len=64, kv_cache_blocks=16)
    submit(engine, 1, prompt=range(3, 53), params=SamplingParams(max_tokens=20))
    (response,) = run_to_completion(engine)
    assert response.error.code == "too_long"
    message = str(response.error)
    assert "50 in the prompt" in message and "70" in message and "64" in message


def poisoned(**changes) -> GenerationRequest:
    """A request built valid, then changed: what a buggy or hostile frontend could send (an
    unpickled request never ran its own validation)."""
    request = GenerationRequest([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=3))
    for name, value in changes.items():
        target = request.sampling_params if hasattr(request.sampling_params, name) else request
        setattr(target, name, value)
    return request


POISONS = {
    "top_k": {"top_k": 2**64},  # once overflowed torch.tensor inside the step: the engine died
    "stop_token_ids": {"stop_token_ids": "ab"},  # once broke the stop check: the engine died
    "temperature": {"temperature": float("nan")},
    "n": {"n": "3"},
    "seed": {"seed": 2**70},
    "cache_salt": {"cache_salt": "\ud800"},
    "priority": {"priority": float("nan")},
    "prompt": {"prompt_token_ids": np.array([5, 10**6], dtype=np.int64)},
}


def test_a_request_broken_after_it_was_built_fails_alone(tiny_model):
    engine = make_engine(tiny_model, kv_cache_blocks=16)
    engine.request_queue.enqueue_request(GenerationRequest([5, 6], GREEDY, request_id=1))
    for request_id, changes in enumerate(POISONS.values(), 2):
        request = poisoned(**changes)
        request.request_id = request_id
        engine.request_queue.enqueue_request(request)
    engine.request_queue.enqueue_request(GenerationRequest([7, 8], GREEDY, request_id=99))
    responses = run_to_completion(engine)
    errors = {r.request_id: r.error for r in responses if r.error is not None}
    assert sorted(errors) == list(range(2, 2 + len(POISONS)))
    for (field, _), request_id in zip(POISONS.items(), range(2, 2 + len(POISONS))):
        assert errors[request_id].code == "invalid_request", (field, errors[request_id])
        assert field.split("_")[0] in str(errors[request_id]), (field, errors[request_id])
    assert sorted(finish_order(responses)) == [1, 99]
    assert engine.kv_cache.pool.num_used == 0
