"""Prefix caching: the same tokens with caching on as off (greedy, shared prefixes, chunked
prefill, preemption, n > 1), a shared system prompt computed once, salts that share nothing,
and blocks that stay cached until the pool needs them (least recently freed first)."""

from __future__ import annotations

import random

import pytest

from berth.engine import LLM, SamplingParams
from berth.engine.pyexecutor.block_pool import KVBlockPool
from tests.engine.conftest import kv_blocks_used

BLOCK = 16


@pytest.fixture(scope="module")
def llm(tiny_model):
    """One engine for the tests that measure deltas of its counters (each with prompts of its own)."""
    with LLM(tiny_model, executor="in-process", kv_cache_blocks=64) as engine:
        yield engine


def engine_stats(llm: LLM):
    return llm.executor.engine.stats()


def counters(llm: LLM) -> tuple[int, int, int]:
    stats = engine_stats(llm)
    return stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_computed_tokens


def shared_prefix_prompts(seed: int, prefix_len: int, count: int, suffix_lens=(1, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 500) for _ in range(rng.randint(*suffix_lens))] for _ in range(count)]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, *, staggered: bool) -> list[list[int]]:
    """Every prompt's tokens. Staggered: the first prompt finishes before the others start (so
    they find its blocks cached), else all arrive at once."""
    if staggered:
        first = llm.generate([prompts[0]], params)
        rest = llm.generate(prompts[1:], params)
        outputs = first + rest
    else:
        outputs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "options",
    [
        {"kv_cache_blocks": 128},  # plenty of room
        {"kv_cache_blocks": 128, "max_num_tokens": 24},  # prompts chunked over several steps
        {"kv_cache_blocks": 14, "max_batch_size": 8},  # short of blocks: preemption, eviction
    ],
    ids=["roomy", "chunked", "preempting"],
)
def test_outputs_with_caching_on_equal_caching_off(tiny_model, options):
    prompts = shared_prefix_prompts(0, 48, 8) + shared_prefix_prompts(1, 20, 4) + [[7] * 33, [7] * 33]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = {}
    for caching in (True, False):
        with LLM(tiny_model, executor="in-process", enable_prefix_caching=caching, **options) as llm:
            results[caching] = (
                run(llm, prompts, params, staggered=True),
                run(llm, prompts, params, staggered=False),
            )
            stats = engine_stats(llm)
            assert kv_blocks_used(llm) == 0
            if caching:
                assert stats.prefix_cache_hits > 0
                if "kv_cache_blocks" in options and options["kv_cache_blocks"] < 20:
                    assert stats.num_preemptions > 0, "the pool was meant to be too small"
            else:
                assert stats.prefix_cache_hits == 0 and stats.kv_blocks_cached == 0
    assert results[True] == results[False]


def test_a_shared_system_prompt_is_computed_once(llm):
    system = 64  # four full blocks
    prompts = shared_prefix_prompts(2, system, 5, suffix_lens=(3, 12))
    max_tokens = 4
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    queries, hits, computed = counters(llm)
    llm.generate([prompts[0]], params)
    llm.generate(prompts[1:], params)  # all at once: the first one's blocks serve them all
    queries, hits, computed = (
        after - before for after, before in zip(counters(llm), (queries, hits, computed))
    )
    later = len(prompts) - 1
    assert hits == later * system
    assert queries == sum(len(p) for p in prompts)
    # Every prompt token is computed once, but the system prompt's only the first time; each
    # sampled token but the last is computed as the next step's input.
    assert computed == sum(len(p) for p in prompts) - later * system + len(prompts) * (max_tokens - 1)


def test_the_n_sequences_of_a_request_share_their_prompts_blocks(llm):
    prompt = list(range(100, 140))  # 40 tokens: two full blocks and a partial one
    _, hits, _ = counters(llm)
    params = SamplingParams(n=4, temperature=0, max_tokens=3, ignore_eos=True)
    (output,) = llm.generate([prompt], params)
    assert len({tuple(o.token_ids) for o in output.outputs}) == 1
    # In the same step, the later three start from the blocks the first one is computing.
    assert counters(llm)[1] - hits == 3 * 2 * BLOCK


def test_an_n_request_fits_a_pool_its_sequences_fill_one_after_another(tiny_model):
    """Defect 1: three 100-token sequences need 21 blocks for their prompts, the pool holds 16;
    each alone fits. They enter the batch together and take blocks as they get them: the request
    completes, and the one queued behind it too (without caching, nothing is shared)."""
    prompt = list(range(3, 103))
    params = SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(tiny_model, executor="in-process", kv_cache_blocks=16, enable_prefix_caching=False) as llm:
        big = llm.generate_async(prompt, params)
        behind = llm.generate_async([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
        outputs = big.result(timeout=120).outputs
        assert behind.result(timeout=60).finished
        alone = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        assert kv_blocks_used(llm) == 0
    assert [o.token_ids for o in outputs] == [alone[0].outputs[0].token_ids] * 3


def test_different_salts_share_nothing(llm):
    prompt = list(range(200, 267))  # four full blocks and three tokens
    params = SamplingParams(temperature=0, max_tokens=2)

    def hits_of(salt: str | None) -> int:
        before = counters(llm)[1]
        llm.generate([prompt], params, cache_salt=salt)
        return counters(llm)[1] - before

    assert hits_of("tenant-a") == 0
    assert hits_of("tenant-b") == 0  # the same tokens, another tenant: computed again
    assert hits_of(None) == 0
    assert hits_of("tenant-a") == 4 * BLOCK  # its own blocks are still cached
    assert hits_of("tenant-b") == 4 * BLOCK
    assert hits_of(None) == 4 * BLOCK


@pytest.mark.parametrize(
    ("salt", "message"),
    [("", "non-empty"), ("é" * 129, "256 bytes"), ("\ud800", "surrogate"), (5, "string")],
)
def test_a_bad_cache_salt_is_refused_naming_it(llm, salt, message):
    with pytest.raises(ValueError, match=f"cache_salt.*{message}"):
        llm.generate_async([5, 6], SamplingParams(max_tokens=1), cache_salt=salt)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=1), cache_salt="é" * 128)[0].finished


def test_an_aborted_sequence_leaves_its_blocks_cached_not_held(llm):
    prompt = list(range(300, 357))  # three full blocks and nine tokens
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    long = llm.generate_async(prompt, params, streaming=True)
    for update in long:
        if len(update.outputs[0].token_ids) >= 20:
            long.abort()
    aborted = long.result(timeout=30).outputs[0]
    assert aborted.finish_reason == "abort"
    assert kv_blocks_used(llm) == 0
    # Its blocks stay cached after it ended: its prompt's three full ones and the first of its
    # output (computed once seven tokens were generated), held by nobody.
    again = prompt + aborted.token_ids[:23]
    _, hits, _ = counters(llm)
    llm.generate([again], SamplingParams(max_tokens=1))
    assert counters(llm)[1] - hits == 4 * BLOCK  # all but the block holding its last token


def test_the_pool_hands_out_uncached_blocks_then_the_least_recently_freed():
    pool = KVBlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"prefix-a")
    pool.cache(b, b"prefix-b")
    pool.free([b])  # b is freed first, so it is evicted first
    pool.free([a])
    assert pool.num_free == 4 and pool.num_used == 0 and pool.num_cached == 2
    assert pool.cached_block(b"prefix-a") == a
    fresh = pool.allocate(2)  # never-used blocks go before cached ones
    assert set(fresh).isdisjoint({a, b}) and pool.num_cached == 2
    (evicted,) = pool.allocate(1)
    assert evicted == b and pool.cached_block(b"prefix-b") is None
    assert pool.cached_block(b"prefix-a") == a


def test_a_cached_block_held_by_two_is_free_only_when_both_let_go():
    pool = KVBlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, b"shared")
    pool.hold(block)  # a second sequence starts from it
    pool.free([block])
    assert not pool.is_free(block) and pool.num_free == 1
    pool.free([block])
    assert pool.is_free(block) and pool.num_free == 2 and pool.cached_block(b"shared") == block
    pool.hold(block)  # taken back from the free blocks, not copied
    assert pool.num_free == 1 and pool.cached_block(b"shared") == block
