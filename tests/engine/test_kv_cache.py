"""The KV block pool and how it is sized."""

from __future__ import annotations

import pytest
import torch

from berth.engine.pyexecutor.kv_cache import KVBlockPool, plan_num_blocks


def test_pool_allocates_distinct_blocks_and_takes_them_back():
    pool = KVBlockPool(8)
    first, second = pool.allocate(3), pool.allocate(5)
    assert len(set(first + second)) == 8 and pool.num_free == 0 and pool.usage == 1.0
    pool.free(first)
    assert pool.num_used == 5
    assert sorted(pool.allocate(3)) == sorted(first)


def test_pool_refuses_to_overcommit():
    pool = KVBlockPool(2)
    with pytest.raises(Exception, match="2"):
        pool.allocate(3)
    assert pool.num_free == 2  # a refused allocation takes nothing


def test_explicit_block_count_wins():
    blocks = plan_num_blocks(
        explicit_blocks=7,
        memory_fraction=0.9,
        bytes_per_block=1,
        max_useful_blocks=100,
        device=torch.device("cpu"),
    )
    assert blocks == 7


def test_fraction_of_free_memory_is_capped_by_what_can_ever_be_used():
    cpu = torch.device("cpu")
    huge = plan_num_blocks(
        explicit_blocks=None, memory_fraction=0.5, bytes_per_block=1024, max_useful_blocks=10**12, device=cpu
    )
    capped = plan_num_blocks(
        explicit_blocks=None, memory_fraction=0.5, bytes_per_block=1024, max_useful_blocks=40, device=cpu
    )
    assert capped == 40
    assert 40 < huge < 10**12  # a fraction of real free memory, not the cap
