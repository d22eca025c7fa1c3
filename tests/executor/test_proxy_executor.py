"""The proxy + worker shape end to end: parity with the in-process engine, streaming, aborts,
request errors, and a crowd of asyncio clients. Every test leaves the worker's KV pool empty."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from berth.engine import LLM, SamplingParams
from berth.engine.executor import GenerationRequest, RequestError
from tests.executor.conftest import ENGINE_OPTIONS
from tests.support.engine_processes import call_with_timeout, wait_until

TIMEOUT = 60


@pytest.fixture(autouse=True)
def pool_is_empty_after_each_test(proxy_llm):
    yield
    # The stats come with every step; an abort's blocks are freed in the step that answers it.
    assert wait_until(lambda: proxy_llm.executor.stats.kv_blocks_used == 0, timeout=10)


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **extra)


def random_prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    ordinary = [t for t in range(len(tokenizer)) if t not in set(tokenizer.all_special_ids)]
    return [[rng.choice(ordinary) for _ in range(n)] for n in lengths]


def stream(result, timeout: float = TIMEOUT) -> list:
    return call_with_timeout(lambda: list(result), timeout)


def run_parity_workload(llm: LLM) -> list[list[int]]:
    prompts = random_prompts(llm.tokenizer, [1, 2, 5, 9, 16, 17, 33, 64, 100, 250, 7, 40])
    results = [
        llm.generate_async(p, greedy(8 + 3 * i, ignore_eos=i % 3 == 0), streaming=i % 2 == 0)
        for i, p in enumerate(prompts)
    ]
    tokens = []
    for i, result in enumerate(results):
        if i % 2 == 0:
            updates = stream(result)
            streamed = [t for u in updates for t in u.outputs[0].token_ids_diff]
            assert streamed == updates[-1].outputs[0].token_ids  # no token lost or repeated
            tokens.append(streamed)
        else:
            tokens.append(result.result(timeout=TIMEOUT).outputs[0].token_ids)
    return tokens


def test_greedy_outputs_equal_the_in_process_engine(proxy_llm, tiny_model):
    through_proxy = run_parity_workload(proxy_llm)
    with LLM(tiny_model, executor="in-process", **ENGINE_OPTIONS) as local:
        in_process = run_parity_workload(local)
    assert through_proxy == in_process
    assert any(len(t) > 0 for t in through_proxy)


def test_the_engine_runs_in_another_process(proxy_llm):
    executor = proxy_llm.executor
    assert executor.engine_pid not in (os.getpid(), -1)
    assert executor.admission_state == "running"
    started = time.perf_counter()
    assert proxy_llm.check_health()
    assert time.perf_counter() - started < 0.05


def test_text_prompts_and_stop_strings_work_across_the_boundary(proxy_llm):
    full = proxy_llm.generate("the quick brown fox", greedy(20, ignore_eos=True))[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    # Two visible characters from the middle of the text (whitespace alone would be a poor stop).
    middle = len(full.text) // 2
    start = next(i for i in range(middle, len(full.text) - 1) if full.text[i : i + 2].strip())
    stop = full.text[start : start + 2]
    stopped = proxy_llm.generate("the quick brown fox", greedy(20, ignore_eos=True, stop=stop))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert full.text.startswith(stopped.text) and stop not in stopped.text


def test_abort_mid_stream_stops_that_request_only_and_frees_its_blocks(proxy_llm):
    executor = proxy_llm.executor
    prompt_a, prompt_b = random_prompts(proxy_llm.tokenizer, [100, 100], seed=1)
    params = greedy(40, ignore_eos=True)
    alone = proxy_llm.generate([prompt_b], params)[0].outputs[0].token_ids

    a = proxy_llm.generate_async(prompt_a, params, streaming=True)
    b = proxy_llm.generate_async(prompt_b, params, streaming=True)

    def abort_once_both_run() -> int:
        # b's submission can reach the worker a few steps after a's: the abort waits for a step
        # that ran both (one stats snapshot, so its count and its blocks agree).
        for update in a:
            stats = executor.stats
            if len(update.outputs[0].token_ids) >= 5 and stats.num_running == 2:
                a.abort()
                return stats.kv_blocks_used
        raise AssertionError("a finished before it could be aborted")

    blocks_with_both = call_with_timeout(abort_once_both_run, TIMEOUT)
    out_a = a.result(timeout=TIMEOUT).outputs[0]
    blocks_after_abort = executor.stats.kv_blocks_used  # the stats of the step that answered the abort
    out_b = b.result(timeout=TIMEOUT).outputs[0]

    assert out_a.finish_reason == "abort" and 5 <= len(out_a.token_ids) < 40
    assert out_b.finish_reason == "length" and out_b.token_ids == alone
    # 100-token prompts: each holds >= 7 blocks of 16 while running; b alone never needs more than 9.
    b_at_most = -(-(100 + 40) // 16)
    assert blocks_with_both > b_at_most >= blocks_after_abort
    assert wait_until(lambda: executor.stats.kv_blocks_used == 0, timeout=10)


def test_abort_of_a_finished_request_is_a_no_op(proxy_llm):
    result = proxy_llm.generate_async("over the", greedy(3))
    result.result(timeout=TIMEOUT)
    proxy_llm.executor.abort(result.request_id)  # the worker logs it at debug level and goes on
    proxy_llm.executor.abort(10**9)  # never existed
    assert len(proxy_llm.generate("over the", greedy(3))[0].outputs[0].token_ids) == 3
    assert proxy_llm.check_health()


def test_a_request_error_fails_that_request_alone(proxy_llm):
    good = proxy_llm.generate_async("the lazy dog", greedy(6, ignore_eos=True))
    bad = proxy_llm.executor.submit(GenerationRequest([5, 1_000_000], greedy(4)))
    too_long = proxy_llm.generate_async([3] * 1000, greedy(100))
    # Changed after it was built, as a buggy frontend could: the worker unpickles it without
    # running its validation; the engine checks it again and fails it alone (this top_k once
    # overflowed inside the engine step and killed it).
    broken = GenerationRequest([5, 6], SamplingParams(temperature=1.0, max_tokens=4))
    broken.sampling_params.top_k = 2**64
    broken_result = proxy_llm.executor.submit(broken)
    with pytest.raises(RequestError, match="top_k"):
        broken_result.result(timeout=TIMEOUT)
    with pytest.raises(RequestError, match="out of range for the vocabulary"):
        bad.result(timeout=TIMEOUT)
    with pytest.raises(RequestError) as error:
        too_long.result(timeout=TIMEOUT)
    assert error.value.code == "too_long"
    with pytest.raises(RequestError):  # sticky: the same error at once, every time
        bad.result(timeout=0)
    assert len(good.result(timeout=TIMEOUT).outputs[0].token_ids) == 6
    assert proxy_llm.check_health()


@pytest.mark.slow  # a worker process under load until it is killed
def test_500_concurrent_asyncio_requests_all_complete_once(proxy_llm):
    executor = proxy_llm.executor
    rng = random.Random(3)
    prompts = random_prompts(proxy_llm.tokenizer, [rng.randint(1, 24) for _ in range(500)], seed=3)
    lengths = [rng.randint(1, 8) for _ in range(500)]
    dispatches = 0
    original_dispatch = executor._dispatch

    def counting_dispatch(batches):
        nonlocal dispatches
        dispatches += 1
        original_dispatch(batches)

    async def consume(result, streaming: bool):
        if not streaming:
            return await result
        last, streamed = None, []
        async for update in result:
            streamed += update.outputs[0].token_ids_diff
            last = update
        assert streamed == last.outputs[0].token_ids
        return last

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = 0
        original_wake = loop.call_soon_threadsafe

        def counting_wake(*args, **kwargs):
            nonlocal wakeups
            wakeups += 1
            return original_wake(*args, **kwargs)

        loop.call_soon_threadsafe = counting_wake
        results = [
            proxy_llm.generate_async(p, greedy(n, ignore_eos=True), streaming=i % 2 == 0)
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ]
        outputs = await asyncio.wait_for(
            asyncio.gather(*(consume(r, i % 2 == 0) for i, r in enumerate(results))), TIMEOUT
        )
        return results, outputs, wakeups

    executor._dispatch = counting_dispatch
    try:
        results, outputs, wakeups = asyncio.run(main())
    finally:
        del executor._dispatch
    assert len({r.request_id for r in results}) == 500
    assert [o.request_id for o in outputs] == [r.request_id for r in results]
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    assert all(o.finished for o in outputs)
    # The loop is woken once per batch of steps, not once per token or per request.
    assert wakeups <= dispatches < sum(lengths)
    assert executor.num_pending == 0
