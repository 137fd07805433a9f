from __future__ import annotations

import pytest

from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request, RequestStatus
from kvflow.core.scheduler import Scheduler
from kvflow.sampling_params import SamplingParams


def _request(rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, first: int | None = None) -> Request:
    # Distinct prompts unless `first` is given: equal prompts share (and wait for) cached blocks.
    first = sum(map(ord, rid)) * 1000 if first is None else first
    return Request(rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens), max_tokens,
                   frozenset({0}), priority=priority)


def _scheduler(budget=64, max_seqs=8, blocks=64, block_size=4, max_len=256, policy="fcfs") -> Scheduler:
    return Scheduler(SchedulerConfig(budget, max_seqs, policy), KVCacheManager(blocks, block_size), max_len)


def _run_step(s: Scheduler, token: int = 5):
    out = s.schedule()
    s.update_from_output(out, {c.request_id: [token] for c in out.chunks if c.sample})
    return out


def test_prompt_is_chunked_to_the_token_budget():
    s = _scheduler(budget=10)
    s.add_request(_request("a", 25))
    sizes = [c.num_tokens for c in (_run_step(s).chunks[0], _run_step(s).chunks[0], _run_step(s).chunks[0])]
    assert sizes == [10, 10, 5]
    assert s.requests["a"].output_token_ids == [5]  # only the chunk that reached the end sampled


def test_decodes_come_first_and_share_the_step_with_a_prompt_chunk():
    s = _scheduler(budget=8)
    s.add_request(_request("a", 3))
    _run_step(s)  # a: prefill + first token
    s.add_request(_request("b", 20))
    out = _run_step(s)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 7)]


def test_held_requests_compute_prompt_chunks_but_never_sample():
    """What a grammar whose next mask is not ready gets: no sampling chunk, the rest as usual."""
    s = _scheduler(budget=64)
    for rid, length in (("decoding", 3), ("prefilling", 10), ("other", 3)):
        s.add_request(_request(rid, length))
    _run_step(s)  # all three prefilled and sampled once
    s.add_request(_request("new", 6))
    s.requests["prefilling"].num_computed_tokens = 4  # (as after a preemption's partial recompute)
    out = s.schedule(held={"decoding", "prefilling", "new"})
    assert [(c.request_id, c.num_tokens, c.sample) for c in out.chunks] == [("other", 1, True), ("prefilling", 6, False)]
    assert [r.request_id for r in s.waiting] == ["new"]  # a held waiting request is not started either
    s.update_from_output(out, {"other": [5]})
    out = s.schedule()  # released: each samples again
    assert {(c.request_id, c.sample) for c in out.chunks} == {("decoding", True), ("prefilling", True),
                                                              ("other", True), ("new", True)}


def test_only_held_requests_is_no_stall():
    s = _scheduler()
    s.add_request(_request("a", 3))
    out = s.schedule(held={"a"})  # its first chunk would sample: it waits, and nothing is wrong
    assert out.chunks == [] and s.num_waiting == 1


def test_max_num_seqs_caps_running_requests():
    s = _scheduler(max_seqs=2)
    for rid in "abc":
        s.add_request(_request(rid, 4))
    out = s.schedule()
    assert {c.request_id for c in out.chunks} == {"a", "b"}
    assert s.num_waiting == 1


def test_newest_running_request_is_preempted_and_recomputed():
    s = _scheduler(blocks=4, block_size=4)
    s.add_request(_request("old", 7, max_tokens=8))
    s.add_request(_request("new", 7, max_tokens=8))
    _run_step(s)  # both prefilled (positions 0-6): 2 blocks each, pool full
    assert _run_step(s).preempted_request_ids == []  # position 7 still fits in block 2
    out = _run_step(s)  # position 8 needs a third block each
    assert out.preempted_request_ids == ["new"]
    new = [r for r in s.waiting if r.request_id == "new"][0]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.output_token_ids == [5, 5]  # its output so far is kept and recomputed, not resampled
    while s.has_unfinished_requests():
        _run_step(s)
    assert s.kv_cache.usage == 0.0


def test_admission_refuses_requests_that_can_never_fit():
    s = _scheduler(blocks=4, block_size=4, max_len=100)
    with pytest.raises(ValueError, match=r"prompt \(98 tokens\) \+ max_tokens \(4\) = 102 tokens exceeds max_model_len \(100\)"):
        s.add_request(_request("long", 98))
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        s.add_request(_request("big", 15, max_tokens=6))
    assert not s.has_unfinished_requests()


def test_finishing_frees_blocks_and_reports_the_id_once():
    s = _scheduler()
    s.add_request(_request("a", 5, max_tokens=2))
    _run_step(s)
    _run_step(s)
    assert not s.has_unfinished_requests()
    assert s.kv_cache.usage == 0.0
    assert s.schedule().finished_request_ids == {"a"}
    assert s.schedule().finished_request_ids == set()


def test_eos_stops_only_after_min_tokens():
    s = _scheduler()
    r = Request("a", [1, 2], SamplingParams(max_tokens=5, min_tokens=2), 5, frozenset({0}))
    s.add_request(r)
    _run_step(s, token=0)
    assert r.status is RequestStatus.RUNNING
    _run_step(s, token=0)
    assert r.status is RequestStatus.FINISHED_STOPPED


def test_equal_prompt_waits_for_the_twin_and_then_hits_the_cache():
    s = _scheduler(budget=64, block_size=4)
    s.add_request(_request("a", 10, first=1))
    s.add_request(_request("b", 10, first=1))
    out = _run_step(s)
    assert [c.request_id for c in out.chunks] == ["a"]  # b's first block is being computed by a
    out = _run_step(s)
    chunks = {c.request_id: c for c in out.chunks}
    assert chunks["b"].start_pos == 9 and chunks["b"].num_tokens == 1  # the whole prompt but its last token
    assert s.requests["b"].num_cached_tokens == 9
    assert (s.kv_cache.prefix_cache_queries, s.kv_cache.prefix_cache_hits) == (20, 9)
    assert out.block_copies == [(2, 3)]  # b copies the tail block it recomputes a token in; a writes past it


def test_priority_request_preempts_lower_priority_when_the_pool_is_full():
    s = _scheduler(blocks=4, block_size=4, policy="priority")
    s.add_request(_request("low", 12, max_tokens=4, priority=5))
    _run_step(s)  # low holds 3 of 4 blocks
    s.add_request(_request("high", 8, max_tokens=4, priority=0))
    out = _run_step(s)
    assert out.preempted_request_ids == ["low"]
    assert [c.request_id for c in out.chunks] == ["high"]
    while s.has_unfinished_requests():
        _run_step(s)
    assert s.kv_cache.usage == 0.0


def test_fcfs_never_preempts_for_a_waiting_request():
    s = _scheduler(blocks=4, block_size=4)
    s.add_request(_request("old", 12, max_tokens=4, priority=5))
    _run_step(s)
    s.add_request(_request("new", 8, max_tokens=4, priority=0))  # priority is ignored under fcfs
    out = _run_step(s)
    assert out.preempted_request_ids == [] and [c.request_id for c in out.chunks] == ["old"]


def test_priority_orders_the_waiting_queue_fcfs_within_a_level():
    s = _scheduler(max_seqs=1, policy="priority")
    for rid, prio in [("a", 2), ("b", 1), ("c", 2), ("d", 1)]:
        s.add_request(_request(rid, 3, max_tokens=1, priority=prio))
    order = []
    while s.has_unfinished_requests():
        order += [c.request_id for c in _run_step(s).chunks]
    assert order == ["b", "d", "a", "c"]


def test_whole_prompt_hit_that_cannot_afford_its_copy_falls_back_to_whole_blocks():
    s = _scheduler(blocks=3, block_size=4)
    s.add_request(_request("a", 12, max_tokens=1, first=1))
    _run_step(s)  # a computes 12 tokens in all 3 blocks, samples its only token, frees them (cached)
    s.add_request(_request("b", 12, max_tokens=1, first=1))
    out = _run_step(s)  # 3 cached blocks + 1 for the copy do not fit in 3: reuse 2 blocks instead
    assert [(c.request_id, c.start_pos, c.num_tokens) for c in out.chunks] == [("b", 8, 4)]
    assert out.block_copies == [] and not s.has_unfinished_requests()
