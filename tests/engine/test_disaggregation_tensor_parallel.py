"""Disaggregated prefill and decode with tensor-parallel worlds (real MPI ranks): a context world
of 2 ranks and a generation world of 2 ranks give one engine's greedy tokens, streamed or not;
an engine of 1 rank and a world of 2 reshard the KV either way; a failed or late transfer in a
world fails that request alone and leaves no block held; a world whose ranks replicate one KV
head splits too, and so does SmolLM2 over 3 ranks; a context world killed while it holds a pin
is reported dead, and only the request that needed it fails. One world of each part serves
most of the module."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import time

import pytest
import torch

from berth.engine import LLM, ContextOnly, GenerationOnly, RequestError, SamplingParams
from berth.engine.executor import EngineDeadError
from berth.engine.models.parallel import attention_shard
from berth.engine.pyexecutor import kv_slices
from tests.engine.conftest import kv_blocks_used, prompts_of_many_lengths
from tests.support.engine_processes import no_world_outlives, wait_until

KEY = secrets.token_hex(32)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = {"max_batch_size": 16, "kv_transfer_key": KEY}
SERVES = {"kv_transfer_endpoint": "tcp://127.0.0.1:*"}  # a context part's KV transfer socket


@pytest.fixture(scope="module", autouse=True)
def no_rank_outlives_the_module():
    yield
    no_world_outlives()


@pytest.fixture(scope="module")
def single(tiny_model):
    """One engine of one rank: the reference, and either part opposite a world."""
    with LLM(tiny_model, executor="in-process", kv_cache_blocks=160, **SERVES, **ENGINE) as engine:
        yield engine


@pytest.fixture(scope="module")
def context_world(tiny_model):
    with LLM(tiny_model, tensor_parallel_size=2, kv_cache_blocks=160, **SERVES, **ENGINE) as world:
        yield world


@pytest.fixture(scope="module")
def generation_world(tiny_model):
    """Another block size than the context parts': the KV travels per token."""
    with LLM(tiny_model, tensor_parallel_size=2, kv_cache_blocks=200, kv_block_size=8, **ENGINE) as world:
        yield world


def blocks_held(llm: LLM) -> int:
    """Blocks held in an engine of any size, read from a fresh step's stats (a world's ranks other
    than 0 hold no block state: rank 0 decides every block of the world)."""
    if getattr(llm.executor, "engine", None) is not None:  # in this process
        return kv_blocks_used(llm)
    llm.generate([[5, 6]], SamplingParams(max_tokens=1))
    return llm.executor.stats.kv_blocks_used


def wait_until_no_block_held(*engines: LLM, timeout: float = 10.0) -> None:
    """Releases travel back asynchronously: a context part frees its pins when they arrive."""
    deadline = time.monotonic() + timeout
    while any(blocks_held(llm) for llm in engines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [blocks_held(llm) for llm in engines] == [0] * len(engines)


def split(context: LLM, generation: LLM, prompts, params=GREEDY, **generation_options):
    firsts = context.generate(prompts, params, disaggregated=ContextOnly())
    for first in firsts:
        assert first.kv_handle is not None and len(first.outputs[0].token_ids) == 1
    splits = [GenerationOnly(first.kv_handle, **generation_options) for first in firsts]
    return firsts, generation.generate(prompts, params, disaggregated=splits)


def tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def test_two_worlds_of_two_ranks_give_one_engines_greedy_tokens(single, context_world, generation_world):
    prompts = prompts_of_many_lengths(single.tokenizer)
    expected = tokens(single.generate(prompts, GREEDY))
    assert tokens(context_world.generate(prompts, GREEDY)) == expected  # a world alone: the same
    firsts, outputs = split(context_world, generation_world, prompts)
    assert firsts[0].kv_handle.layout.tensor_parallel_size == 2
    assert tokens(outputs) == expected
    assert [f.outputs[0].token_ids for f in firsts] == [e[:1] for e in expected]
    assert [o.outputs[0].text for o in outputs] == [
        o.outputs[0].text for o in single.generate(prompts, GREEDY)
    ]

    prompt = prompts_of_many_lengths(single.tokenizer, lengths=(21,))[0]
    first = context_world.generate([prompt], GREEDY, disaggregated=ContextOnly())[0]
    streamed = list(
        generation_world.generate_async(
            prompt, GREEDY, streaming=True, disaggregated=GenerationOnly(first.kv_handle)
        )
    )
    assert len(streamed) > 2  # token by token, the first one included
    assert streamed[-1].outputs[0].token_ids == single.generate([prompt], GREEDY)[0].outputs[0].token_ids
    wait_until_no_block_held(context_world, generation_world)


def test_one_rank_and_two_ranks_reshard_the_kv_either_way(single, context_world, generation_world):
    prompts = prompts_of_many_lengths(single.tokenizer, lengths=(2, 17, 33, 9))
    expected = tokens(single.generate(prompts, GREEDY))
    firsts, outputs = split(single, generation_world, prompts)  # 1 rank -> 2
    assert firsts[0].kv_handle.layout.tensor_parallel_size == 1
    assert tokens(outputs) == expected
    _, outputs = split(context_world, single, prompts)  # 2 ranks -> 1
    assert tokens(outputs) == expected
    # Another model's KV is refused, whatever the split.
    handle = context_world.generate([prompts[0]], GREEDY, disaggregated=ContextOnly())[0].kv_handle
    other = dataclasses.replace(handle, layout=dataclasses.replace(handle.layout, num_kv_heads=4))
    with pytest.raises(RequestError, match="does not fit this engine's"):
        generation_world.generate([prompts[0]], GREEDY, disaggregated=GenerationOnly(other))
    generation_world.generate([prompts[0]], GREEDY, disaggregated=GenerationOnly(handle))  # its pin goes
    wait_until_no_block_held(single, context_world, generation_world)


def closed_port_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def test_failed_transfers_in_worlds_fail_their_request_alone_and_leak_no_block(
    single, context_world, generation_world
):
    """While good splits run in the generation world: a pull from a context engine that is gone
    (timeout), a pin that expired (an error, or the prompt run locally), and a pull aborted in
    flight. Each ends alone; afterwards neither world holds a block."""
    prompts = prompts_of_many_lengths(single.tokenizer, lengths=(3, 19, 40, 7, 25, 12))
    expected = tokens(single.generate(prompts, GREEDY))
    good = context_world.generate(prompts[:3], GREEDY, disaggregated=ContextOnly())
    expired = context_world.generate(prompts[3:5], GREEDY, disaggregated=ContextOnly(pin_seconds=0.05))
    aborted = context_world.generate([prompts[5]], GREEDY, disaggregated=ContextOnly())[0]
    time.sleep(0.2)  # the short pins time out
    gone = dataclasses.replace(good[0].kv_handle, address=closed_port_address())

    def submit(prompt, handle, **options):
        return generation_world.generate_async(
            prompt, GREEDY, disaggregated=GenerationOnly(handle, **options)
        )

    results = [submit(p, f.kv_handle) for p, f in zip(prompts[:3], good)]
    late = submit(prompts[0], gone, timeout=0.5)
    expired_error = submit(prompts[3], expired[0].kv_handle)
    expired_local = submit(prompts[4], expired[1].kv_handle, fallback="local")
    in_flight = submit(prompts[5], aborted.kv_handle)
    in_flight.abort()

    assert [r.result(timeout=60).outputs[0].token_ids for r in results] == expected[:3]
    with pytest.raises(RequestError, match="did not answer within the transfer timeout"):
        late.result(timeout=30)
    with pytest.raises(RequestError, match=r"KV transfer from the context engine .* \(expired or released\)"):
        expired_error.result(timeout=30)
    assert expired_local.result(timeout=60).outputs[0].token_ids == expected[4]
    assert in_flight.result(timeout=30).outputs[0].finish_reason in ("abort", "length")
    wait_until_no_block_held(context_world, generation_world)
    assert context_world.check_health() and generation_world.check_health()


def test_a_context_world_that_dies_holding_a_pin_fails_only_the_request_that_needed_it(
    tiny_model, single, generation_world
):
    """kill -9 of a context world's rank after prefill: that world is reported dead, the pull
    from it fails alone (a timeout), and the generation world goes on, holding no block."""
    prompt = prompts_of_many_lengths(single.tokenizer, lengths=(14,))[0]
    doomed = LLM(tiny_model, tensor_parallel_size=2, kv_cache_blocks=32, **SERVES, **ENGINE)
    try:
        handle = doomed.generate([prompt], GREEDY, disaggregated=ContextOnly())[0].kv_handle
        (identity,) = doomed.executor.identities
        follower = {rank: pid for rank, pid, _ in identity.world}[1]
        os.kill(follower, signal.SIGKILL)
        assert wait_until(lambda: not doomed.check_health(), 15), "the dead world was not reported"
        with pytest.raises(EngineDeadError):
            doomed.generate([prompt], GREEDY)
        split_from_the_dead = GenerationOnly(handle, timeout=1)
        pending = generation_world.generate_async(prompt, GREEDY, disaggregated=split_from_the_dead)
        others = split(single, generation_world, [prompt])[1]
        assert tokens(others) == tokens(single.generate([prompt], GREEDY))
        with pytest.raises(RequestError, match="did not answer within the transfer timeout"):
            pending.result(timeout=30)
        wait_until_no_block_held(single, generation_world)
    finally:
        doomed.shutdown()


def test_a_world_that_replicates_its_kv_head_splits_with_one_rank_either_way(tiny_tp3):
    """One KV head over 2 ranks: each rank holds a replica; the context world serves it once, and
    every rank of the generation world writes it."""
    with (
        LLM(tiny_tp3, executor="in-process", kv_cache_blocks=64, **SERVES, **ENGINE) as one,
        LLM(tiny_tp3, tensor_parallel_size=2, kv_cache_blocks=64, **SERVES, **ENGINE) as world,
    ):
        prompts = prompts_of_many_lengths(one.tokenizer, lengths=(5, 20, 37))
        expected = tokens(one.generate(prompts, GREEDY))
        firsts, outputs = split(world, one, prompts)
        assert firsts[0].kv_handle.layout.num_kv_heads == 1
        assert tokens(outputs) == expected
        assert tokens(split(one, world, prompts)[1]) == expected
        wait_until_no_block_held(one, world)


@pytest.mark.slow  # MPI worlds on either side of the split
def test_smollm2_over_three_ranks_and_one_splits_either_way(smollm2):
    """The real model (9 query heads and 3 KV heads: TP 2 cannot split them, TP 3 can), a prompt
    over several prefill chunks: a world of 3 ranks and an engine of 1 reshard the KV both ways
    and give one engine's greedy tokens."""
    from tests.engine.test_real_model import CHUNK, prompts

    options = {"max_num_tokens": CHUNK, "kv_cache_blocks": 24, "max_batch_size": 4, **SERVES, **ENGINE}
    params = SamplingParams(temperature=0, max_tokens=6)
    with (
        LLM(smollm2, executor="in-process", **options) as one,
        LLM(smollm2, tensor_parallel_size=3, **options) as world,
    ):
        batch = prompts(one.tokenizer)[1:3]  # a long chat prompt (two chunks) and a short one
        expected = tokens(one.generate(batch, params))
        assert tokens(world.generate(batch, params)) == expected
        firsts, outputs = split(world, one, batch, params)
        assert firsts[0].kv_handle.layout.tensor_parallel_size == 3
        assert tokens(outputs) == expected
        assert tokens(split(one, world, batch, params)[1]) == expected
        wait_until_no_block_held(one, world)


def test_every_rank_takes_its_heads_of_the_whole_and_rank_0_gathers_them_back():
    """Heads split (4 over 2 ranks) and replicated (1 over 3 ranks: taken once, from the first)."""
    for num_kv_heads, size in ((4, 2), (1, 3), (2, 4)):
        whole = torch.randn(2, 2, 5, num_kv_heads, 8)  # [layer][key|value][token][kv head][dim]
        by_rank = [attention_shard(12, num_kv_heads, rank, size) for rank in range(size)]
        parts = [kv_slices.rank_slice(whole, shard).clone() for shard in by_rank]
        assert all(part.shape[-2] == by_rank[0].num_kv_heads for part in parts)
        assert torch.equal(kv_slices.whole_heads(parts, by_rank), whole)


def test_slots_of_a_block_table():
    assert kv_slices.slots_of([3, 1], 6, 4).tolist() == [12, 13, 14, 15, 4, 5]
