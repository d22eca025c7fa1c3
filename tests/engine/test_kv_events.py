"""KV-cache events: a subscriber rebuilds an engine's prefix cache from its events alone (stored,
evicted, cleared by a sleep), a late one from a snapshot plus the events after it, and both
match the engine's own cache; every block's hash checks against its parent and tokens."""

from __future__ import annotations

import hashlib
import random
from array import array

import pytest
import zmq

from berth.engine import LLM, SamplingParams
from berth.engine.config import EngineConfig
from berth.engine.pyexecutor.kv_cache import _chain_root
from berth.engine.pyexecutor.kv_events import KVEventSubscriber, salt_namespace
from tests.engine.conftest import kv_blocks_used

BLOCK = 4
SALTS = (None, "tenant-a", "tenant-b")


def check_chain(contents: dict[str, dict]) -> None:
    """Every block's hash is SHA-256 over its parent's (or the salt's root) and its tokens."""
    roots = {salt_namespace(salt): _chain_root(salt) for salt in SALTS}
    for block_hash, block in contents.items():
        assert len(block["token_ids"]) == BLOCK
        parent = bytes.fromhex(block["parent"]) if block["parent"] else roots[block["namespace"]]
        assert hashlib.sha256(parent + array("i", block["token_ids"]).tobytes()).hexdigest() == block_hash


def catch_up(subscriber: KVEventSubscriber, publisher_seq: int) -> None:
    for _ in range(200):
        if subscriber.seq >= publisher_seq:
            return
        subscriber.poll(0.05)
    raise AssertionError(f"the subscriber is at batch {subscriber.seq}, the engine at {publisher_seq}")


def workload(llm: LLM, seed: int, count: int) -> None:
    """Shared prefixes, salts, n > 1, an abort: enough distinct blocks for a 24-block pool to evict."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 400) for _ in range(10)] for _ in range(3)]
    results = []
    for i in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 400) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(2, 9), n=2 if i % 5 == 0 else 1)
        results.append(llm.generate_async(prompt, params, cache_salt=SALTS[i % 3]))
    if count > 3:
        results[3].abort()
    for result in results:
        result.result()


def publishing_engine(model, **options) -> LLM:
    """A small pool (24 blocks of 4 tokens: the workloads evict), publishing on free ports."""
    return LLM(
        model,
        executor="in-process",
        kv_cache_blocks=24,
        kv_block_size=BLOCK,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_snapshot_endpoint="tcp://127.0.0.1:*",
        **options,
    )


def test_a_subscriber_rebuilds_the_cache_from_events_and_a_late_one_from_a_snapshot(tiny_model):
    with publishing_engine(tiny_model, max_batch_size=6, kv_events_engine_id="engine-under-test") as llm:
        engine = llm.executor.engine
        publisher = engine.kv_events
        early = KVEventSubscriber(publisher.endpoint, publisher.snapshot_endpoint)
        late = None
        try:
            early.sync()
            assert early.seq == 0 and early.contents.blocks == {}
            workload(llm, seed=1, count=12)
            llm.sleep(level=1)  # the cache is dropped: AllBlocksCleared
            llm.wake_up()
            workload(llm, seed=2, count=10)
            late = KVEventSubscriber(publisher.endpoint, publisher.snapshot_endpoint)
            late.sync()
            assert late.seq > 0 and late.contents.blocks  # it joined a cache with contents
            workload(llm, seed=3, count=14)
            for subscriber in (early, late):
                catch_up(subscriber, publisher.seq)
            engine_blocks = {h.hex() for h in engine.kv_cache.pool.cached_hashes()}
            assert kv_blocks_used(llm) == 0
            for subscriber in (early, late):
                assert subscriber.engine_id == "engine-under-test"
                assert set(subscriber.contents.blocks) == engine_blocks
                check_chain(subscriber.contents.blocks)
            applied = early.contents.applied
            assert applied["BlockStored"] and applied["BlockRemoved"] and applied["AllBlocksCleared"] == 1
            assert early.resyncs == 0  # all from the events: no snapshot after the first
            assert {block["namespace"] for block in early.contents.blocks.values()} == {
                salt_namespace(salt) for salt in SALTS
            }
        finally:
            early.close()
            if late is not None:
                late.close()


def test_a_lost_batch_is_noticed_and_repaired_from_a_snapshot(tiny_model):
    """A subscriber that missed batches (it was not listening) resynchronizes on the next one."""
    with publishing_engine(tiny_model) as llm:
        publisher = llm.executor.engine.kv_events
        subscriber = KVEventSubscriber(publisher.endpoint, publisher.snapshot_endpoint)
        try:
            subscriber.sync()
            subscriber.seq = -5  # as if the snapshot were older than the next batch by a gap
            workload(llm, seed=4, count=3)
            catch_up(subscriber, publisher.seq)
            assert subscriber.resyncs == 1
            assert set(subscriber.contents.blocks) == {
                h.hex() for h in llm.executor.engine.kv_cache.pool.cached_hashes()
            }
        finally:
            subscriber.close()


def test_no_events_without_the_endpoint_and_bad_settings_are_refused(tiny_model):
    with LLM(tiny_model, executor="in-process", kv_cache_blocks=16) as llm:
        assert llm.executor.engine.kv_events is None
        assert llm.executor.engine.kv_cache.event_log is None
    for options, words in (
        ({"kv_events_endpoint": "127.0.0.1:5557"}, "ZeroMQ endpoint"),
        ({"kv_events_snapshot_endpoint": "tcp://127.0.0.1:5558"}, "needs kv_events_endpoint"),
        ({"kv_events_endpoint": "tcp://127.0.0.1:*", "enable_prefix_caching": False}, "prefix caching"),
    ):
        with pytest.raises(ValueError, match=words):
            EngineConfig(model="m", **options)


def test_a_publisher_that_cannot_bind_says_where(tiny_model):
    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    try:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(
            ValueError, match=f"cannot bind the KV events socket \\(tcp://127.0.0.1:{port}\\)"
        ):
            LLM(
                tiny_model,
                executor="in-process",
                kv_cache_blocks=16,
                kv_events_endpoint=f"tcp://127.0.0.1:{port}",
            )
    finally:
        taken.close(linger=0)
        context.term()
