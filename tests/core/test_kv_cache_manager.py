from __future__ import annotations

import pytest

from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_manager import KVCacheManager


def test_allocate_grows_block_table_on_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 1)
    assert len(kv.block_ids("a")) == 1
    assert kv.allocate_slots("a", 4)
    assert len(kv.block_ids("a")) == 1  # still fits in the first block
    assert kv.allocate_slots("a", 5)
    assert len(kv.block_ids("a")) == 2
    assert kv.pool.num_free_blocks == 6


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots("a", 8)
    assert not kv.allocate_slots("b", 8)
    assert kv.block_ids("b") == []
    assert not kv.allocate_slots("a", 13)
    assert len(kv.block_ids("a")) == 2
    assert kv.pool.num_free_blocks == 1


def test_free_returns_every_block_and_blocks_are_not_shared():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    kv.allocate_slots("a", 5)
    kv.allocate_slots("b", 6)
    assert not set(kv.block_ids("a")) & set(kv.block_ids("b"))
    kv.free("a")
    kv.free("b")
    assert kv.usage == 0.0
    kv.free("a")  # freeing twice is harmless: the table is gone


def test_block_pool_refuses_double_release():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(blocks)
