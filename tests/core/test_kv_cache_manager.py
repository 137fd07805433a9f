from __future__ import annotations

import pytest

from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request
from kvflow.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), 8, frozenset(), cache_salt=salt)


def _compute(kv: KVCacheManager, r: Request, upto: int, cached=(), start: int = 0) -> None:
    assert kv.allocate_slots(r, start, upto - start, list(cached))
    r.num_computed_tokens = upto
    kv.cache_computed_blocks(r)


def test_allocate_grows_block_table_on_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(9)))
    assert kv.allocate_slots(a, 0, 1) and len(kv.block_ids("a")[0]) == 1
    assert kv.allocate_slots(a, 1, 3) and len(kv.block_ids("a")[0]) == 1  # still fits in the first block
    assert kv.allocate_slots(a, 4, 1) and len(kv.block_ids("a")[0]) == 2
    assert kv.pool.num_free_blocks == 6


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = _req("a", list(range(13))), _req("b", list(range(100, 108)))
    assert kv.allocate_slots(a, 0, 8)
    assert not kv.allocate_slots(b, 0, 8) and kv.block_ids("b") == ([],)
    assert not kv.allocate_slots(a, 8, 5) and len(kv.block_ids("a")[0]) == 2
    assert kv.pool.num_free_blocks == 1


def test_free_returns_every_block_and_blocks_are_not_shared():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_caching=False)
    a, b = _req("a", [1] * 5), _req("b", [1] * 6)
    kv.allocate_slots(a, 0, 5)
    kv.allocate_slots(b, 0, 6)
    assert not set(kv.block_ids("a")[0]) & set(kv.block_ids("b")[0])
    kv.free(a)
    kv.free(b)
    assert kv.usage == 0.0
    kv.free(a)  # freeing twice is harmless: the table is gone


def test_cached_prefix_is_found_by_content():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(10)))
    _compute(kv, a, 10)  # blocks 0-1 full and cached, the prompt's tail block too
    kv.free(a)
    blocks, tokens = kv.find_cached_prefix(_req("b", list(range(12))))
    assert (len(blocks[0]), tokens) == (2, 8)  # a's two full blocks; b's third block differs from a's tail
    assert kv.find_cached_prefix(_req("c", list(range(8))))[1] == 7  # all of c but the last token, computed for logits
    assert kv.find_cached_prefix(_req("d", [5] + list(range(1, 10)))) == (([],), 0)  # first block differs
    assert kv.find_cached_prefix(_req("e", list(range(12)), salt="tenant-2")) == (([],), 0)


def test_identical_prompt_reuses_everything_but_its_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(10)))
    _compute(kv, a, 10)
    b = _req("b", list(range(10)))
    blocks, tokens = kv.find_cached_prefix(b)
    assert blocks == kv.block_ids("a") and tokens == 9
    assert kv.allocate_slots(b, 9, 1, blocks)
    # Position 9 lies in the shared tail block: b got a private copy before writing it.
    assert kv.block_ids("b")[0][:2] == kv.block_ids("a")[0][:2]
    assert kv.block_ids("b")[0][2] != kv.block_ids("a")[0][2]
    assert kv.take_block_copies() == [(kv.block_ids("a")[0][2], kv.block_ids("b")[0][2])]
    assert kv.take_block_copies() == []


def test_the_owner_writes_past_its_cached_tail_without_a_copy():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(6)))
    _compute(kv, a, 6)
    a.append_output_token(42)
    assert kv.allocate_slots(a, 6, 1)  # slot 2 of the tail block: past the 2 slots the cache covers
    assert kv.take_block_copies() == []
    assert kv.find_cached_prefix(_req("b", list(range(6))))[1] == 5


def test_block_aligned_whole_prompt_copies_its_last_full_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _compute(kv, _req("a", list(range(8))), 8)
    b = _req("b", list(range(8)))
    blocks, tokens = kv.find_cached_prefix(b)
    assert tokens == 7 and len(blocks[0]) == 2
    assert kv.allocate_slots(b, 7, 1, blocks)
    assert len(kv.take_block_copies()) == 1


def test_shared_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(9)))
    _compute(kv, a, 9)
    b = _req("b", list(range(8)) + [50, 51])
    hit, tokens = kv.find_cached_prefix(b)
    assert hit[0] == kv.block_ids("a")[0][:2] and tokens == 8
    assert kv.allocate_slots(b, 8, 2, hit)
    assert [kv.pool.ref_counts[x] for x in hit[0]] == [2, 2]
    assert 8 - kv.pool.num_free_blocks == 3 + 1  # a's three blocks, and one new block for b's tail
    kv.free(a)
    kv.free(b)
    assert kv.usage == 0.0


def test_evicted_blocks_are_forgotten_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5])
    _compute(kv, a, 5)
    kv.free(a)  # blocks freed tail first: [5], then [3, 4], then [1, 2]
    filler = _req("f", [9, 9, 9])
    assert kv.allocate_slots(filler, 0, 3)  # takes 2 blocks: the never-used one and a's tail block
    assert kv.find_cached_prefix(_req("b", [1, 2, 3, 4, 7]))[1] == 4  # a's full blocks survived


def test_in_flight_prefix_is_visible_to_a_twin():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = _req("a", list(range(9))), _req("b", list(range(9)))
    assert kv.allocate_slots(a, 0, 9)
    assert kv.prefix_in_flight(b, 0)  # a will compute b's first block
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    blocks, tokens = kv.find_cached_prefix(b)
    assert not kv.prefix_in_flight(b, tokens) and tokens == 8


def test_block_pool_refuses_double_release():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(blocks)


def test_a_prompt_extending_a_cached_prompt_by_one_token_computes_only_that_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = _req("p", list(range(6)))
    _compute(kv, parent, 6)
    tail = kv.block_ids("p")[0][1]
    kv.free(parent)
    beams = [_req("b", list(range(6)) + [7]), _req("c", list(range(6)) + [8])]
    for beam in beams:
        blocks, tokens = kv.find_cached_prefix(beam)
        assert tokens == 6 and blocks[0][1] == tail
        assert kv.allocate_slots(beam, 6, 1, blocks)
    # The first beam appends after the cached slots of a block only it holds: no copy. The second
    # would write the same slot of a block the first holds: it gets a private copy first.
    assert kv.block_ids("b")[0][1] == tail
    assert kv.take_block_copies() == [(tail, kv.block_ids("c")[0][1])]
    assert kv.pool.ref_counts[tail] == 1


def test_a_beam_that_fills_its_block_registers_the_full_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _compute(kv, _req("p", list(range(7))), 7)
    child = _req("c", list(range(7)) + [9])  # its last token completes block 1
    blocks, tokens = kv.find_cached_prefix(child)
    assert tokens == 7
    _compute(kv, child, 8, blocks, start=7)
    grandchild = _req("g", list(range(7)) + [9, 3])
    assert kv.find_cached_prefix(grandchild)[1] == 8  # both full blocks, the second filled by the child
