"""The KV block pool (how it is sized: test_memory_budget.py)."""

from __future__ import annotations

import pytest

from berth.engine.pyexecutor.block_pool import KVBlockPool


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
