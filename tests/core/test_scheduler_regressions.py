"""Scheduler defects found by randomized differential testing, pinned as fixed cases, and the
waiting queue's order and removal."""

from __future__ import annotations

import random

import pytest

from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request, RequestStatus
from kvflow.core.scheduler import Scheduler, SchedulerStallError
from kvflow.core.waiting_queue import WaitingQueue
from kvflow.sampling_params import SamplingParams


def _request(rid: str, prompt: list[int], max_tokens: int = 1, priority: int = 0) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens, frozenset(), priority=priority)


def _drive(s: Scheduler, max_steps: int = 50) -> int:
    """Run to the end with a step bound (a hang is a failure); returns the steps taken."""
    for step in range(max_steps):
        if not s.has_unfinished_requests():
            return step
        out = s.schedule()
        assert out.chunks, "a step with nothing to run while requests wait"
        for chunk in out.chunks:  # every chunk stays inside its block table
            assert chunk.start_pos + chunk.num_tokens <= min(map(len, chunk.block_ids)) * s.kv_cache.block_size
        s.update_from_output(out, {c.request_id: [7] for c in out.chunks if c.sample})
    raise AssertionError(f"not finished after {max_steps} steps")


@pytest.mark.parametrize("block_size,num_blocks,prompt_len", [(1, 1, 1), (16, 2, 17), (4, 3, 9)])
def test_exact_fit_with_a_whole_prompt_hit_does_not_hang(block_size, num_blocks, prompt_len):
    # (prompt_len - 1) % block_size == 0: the sibling finds the whole prompt cached, which would
    # need a spare block for the copy-on-write of the tail; the whole-blocks start needs none.
    s = Scheduler(SchedulerConfig(64, 8), KVCacheManager(num_blocks, block_size), 256)
    prompt = list(range(3, 3 + prompt_len))
    s.add_request(_request("a", prompt))
    s.add_request(_request("b", prompt))  # n=2's second child, or the same prompt sent again
    _drive(s)
    s.add_request(_request("again", prompt))
    _drive(s)
    assert s.kv_cache.usage == 0


def test_a_waiting_request_that_cannot_start_while_nothing_runs_is_reported(monkeypatch):
    s = Scheduler(SchedulerConfig(64, 8), KVCacheManager(8, 4), 256)
    s.add_request(_request("a", [1, 2, 3]))
    monkeypatch.setattr(s.kv_cache, "allocate_slots", lambda *a, **k: False)  # a pool that never has room
    with pytest.raises(SchedulerStallError) as raised:
        s.schedule()
    assert raised.value.request_ids == ["a"]


def test_priority_preemption_does_not_grow_the_chunk_past_its_blocks():
    # b (low priority) holds 5 of 6 blocks and decodes one token; a (high priority) wants 16
    # tokens = 4 blocks, preempts b, and b's returned token must not lengthen a's chunk to 17.
    s = Scheduler(SchedulerConfig(17, 8, "priority"), KVCacheManager(6, 4), 256)
    s.add_request(_request("b", list(range(100, 116)), max_tokens=4, priority=1))
    out = s.schedule()
    s.update_from_output(out, {"b": [7]})
    s.add_request(_request("a", list(range(200, 220)), max_tokens=4, priority=0))
    out = s.schedule()
    assert out.preempted_request_ids == ["b"]
    [chunk] = out.chunks
    assert chunk.request_id == "a" and chunk.num_tokens == 16
    assert chunk.start_pos + chunk.num_tokens <= min(map(len, chunk.block_ids)) * 4


def test_waiting_queue_keeps_order_through_removals_and_requeues():
    rng = random.Random(0)
    requests = [_request(str(i), [1], priority=rng.randrange(3)) for i in range(300)]
    for seq, r in enumerate(requests):
        r.arrival_seq = seq
    queue = WaitingQueue(lambda r: (r.priority, r.arrival_seq))
    model: set[Request] = set()
    for r in requests:
        queue.push(r)
        model.add(r)
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and model:
            victim = rng.choice(sorted(model, key=lambda r: r.arrival_seq))
            assert queue.remove(victim)
            model.discard(victim)
            assert not queue.remove(victim)
        elif op < 0.7 and model:
            first = queue.pop()
            assert first is min(model, key=lambda r: (r.priority, r.arrival_seq))
            model.discard(first)
        else:
            back = rng.choice(requests)
            if back not in model:
                queue.push(back)
                model.add(back)
        assert len(queue) == len(model) and all(r in queue for r in model)
    assert list(queue) == sorted(model, key=lambda r: (r.priority, r.arrival_seq))


class _CountingRequest(Request):
    """Counts equality tests: a scan of the queue compares the target with every entry."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        _CountingRequest.comparisons += 1
        return self is other

    __hash__ = object.__hash__


def test_aborting_waiting_requests_does_not_scan_the_queue():
    s = Scheduler(SchedulerConfig(64, 8), KVCacheManager(64, 4), 256)
    for i in range(2000):
        s.add_request(_CountingRequest(str(i), [1, 2], SamplingParams(max_tokens=1), 1, frozenset()))
    _CountingRequest.comparisons = 0
    s.finish_requests([str(i) for i in range(0, 2000, 2)], RequestStatus.FINISHED_ABORTED)
    assert _CountingRequest.comparisons < 2000  # a list scan makes ~1000 per abort
    assert s.num_waiting == 1000
    assert [r.request_id for r in s.waiting][:3] == ["1", "3", "5"]
