from __future__ import annotations

import pytest

from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request
from kvflow.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), 8, frozenset(), cache_salt=salt)


def _compute(kv: KVCacheManager, r: Request, upto: int) -> None:
    assert kv.allocate_slots(r, upto)
    r.num_computed_tokens = upto
    kv.cache_computed_blocks(r)


def test_allocate_grows_block_table_on_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(9)))
    assert kv.allocate_slots(a, 1) and len(kv.block_ids("a")) == 1
    assert kv.allocate_slots(a, 4) and len(kv.block_ids("a")) == 1  # still fits in the first block
    assert kv.allocate_slots(a, 5) and len(kv.block_ids("a")) == 2
    assert kv.pool.num_free_blocks == 6


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = _req("a", list(range(13))), _req("b", list(range(8)))
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 8) and kv.block_ids("b") == []
    assert not kv.allocate_slots(a, 13) and len(kv.block_ids("a")) == 2
    assert kv.pool.num_free_blocks == 1


def test_free_returns_every_block_and_blocks_are_not_shared():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_caching=False)
    a, b = _req("a", [1] * 5), _req("b", [1] * 6)
    kv.allocate_slots(a, 5)
    kv.allocate_slots(b, 6)
    assert not set(kv.block_ids("a")) & set(kv.block_ids("b"))
    kv.free(a)
    kv.free(b)
    assert kv.usage == 0.0
    kv.free(a)  # freeing twice is harmless: the table is gone


def test_cached_prefix_is_found_by_content_and_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(10)))
    _compute(kv, a, 10)  # blocks 0-1 full and cached, block 2 partial
    kv.free(a)
    hit = kv.find_cached_prefix(_req("b", list(range(12))))
    assert len(hit) == 2  # the two full blocks a computed
    assert len(kv.find_cached_prefix(_req("c", list(range(8))))) == 1  # 8 tokens: the last block is recomputed
    assert kv.find_cached_prefix(_req("d", [5] + list(range(1, 10)))) == []  # first block differs
    assert kv.find_cached_prefix(_req("e", list(range(12)), salt="tenant-2")) == []  # different salt


def test_shared_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(9)))
    _compute(kv, a, 9)
    b = _req("b", list(range(8)) + [50, 51])
    hit = kv.find_cached_prefix(b)
    assert hit == kv.block_ids("a")[:2]
    assert kv.allocate_slots(b, 10, hit)
    assert [kv.pool.ref_counts[x] for x in hit] == [2, 2]
    used = 8 - kv.pool.num_free_blocks
    assert used == 3 + 1  # a's three blocks, and one new block for b's tail
    kv.free(a)
    kv.free(b)
    assert kv.usage == 0.0


def test_evicted_blocks_are_forgotten_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5])
    _compute(kv, a, 5)
    kv.free(a)  # blocks freed tail first: [4,5]-block, then [3,4], then [1,2]
    filler = _req("f", [9, 9, 9])
    assert kv.allocate_slots(filler, 3)  # takes 2 blocks: the never-used one and a's partial tail block
    assert len(kv.find_cached_prefix(_req("b", [1, 2, 3, 4, 7]))) == 2  # a's full blocks survived


def test_in_flight_prefix_is_visible_to_a_twin():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = _req("a", list(range(9))), _req("b", list(range(9)))
    assert kv.allocate_slots(a, 9)
    assert kv.prefix_in_flight(b, 0)  # a will compute b's first block
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    assert not kv.prefix_in_flight(b, 2)
    assert len(kv.find_cached_prefix(b)) == 2


def test_block_pool_refuses_double_release():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(blocks)
