"""The speculative seam of the scheduler, with no model: proposals ride in a decode's chunk, the
rejected ones are rolled back before any block is hashed, accepted tokens are checked for stops one
by one, and proposals never cost anyone else a block."""

from __future__ import annotations

from kvflow.config import SchedulerConfig
from kvflow.core.block_hash import extend_block_hashes
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request, RequestStatus
from kvflow.core.scheduler import Scheduler
from kvflow.sampling_params import SamplingParams

EOS = 0


class FixedPolicy:
    """Propose `k` tokens for every request."""

    def __init__(self, k: int, reserves_kv_slots: bool = False) -> None:
        self.k, self.reserves_kv_slots = k, reserves_kv_slots
        self.observed: list[tuple[str, int, int]] = []

    def num_lookahead_tokens(self, request_id: str, batch_size: int) -> int:
        return self.k

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.observed.append((request_id, num_drafted, num_accepted))

    def forget(self, request_id: str) -> None:
        pass


def _scheduler(policy=None, budget=64, blocks=64, block_size=4) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, 8), KVCacheManager(blocks, block_size), 256, speculation=policy)


def _request(rid: str, prompt: list[int], max_tokens: int = 16, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), max_tokens, frozenset({EOS}))


def _prefill(s: Scheduler, token: int = 50, drafts: dict[str, list[int]] | None = None):
    out = s.schedule()
    s.update_from_output(out, {c.request_id: [token] for c in out.chunks if c.sample}, drafts)
    return out


def test_a_decode_verifies_its_proposals_and_rolls_back_the_rejected():
    s = _scheduler(FixedPolicy(3))
    r = _request("a", [1, 2, 3, 4, 5])
    s.add_request(r)
    out = _prefill(s, 50, {"a": [60, 61, 62]})
    assert out.chunks[0].num_lookahead_tokens == 3 and not out.chunks[0].is_decode  # the prompt
    assert r.spec_token_ids == [60, 61, 62]
    out = s.schedule()
    chunk = out.chunks[0]
    assert (chunk.token_ids, chunk.start_pos, chunk.num_spec_tokens) == ([50, 60, 61, 62], 5, 3)
    assert chunk.is_decode  # a verification: one token to sample after the proposals
    assert chunk.spec_token_ids == [60, 61, 62] and out.num_batched_tokens == 4
    # 60 accepted, 61 rejected and replaced by 70: positions 5 (50) and 6 (60) hold accepted KV.
    produced = s.update_from_output(out, {"a": [60, 70]}, {"a": [80]})
    assert produced == [(r, 2)]
    assert r.output_token_ids == [50, 60, 70] and r.num_computed_tokens == 7
    assert r.spec_token_ids == [80]
    assert s.speculation.observed == [("a", 3, 1)]


def test_only_accepted_tokens_enter_the_prefix_cache():
    s = _scheduler(FixedPolicy(4))
    r = _request("a", [1, 2, 3, 4, 5, 6])  # block size 4: block 1 holds positions 4..7
    s.add_request(r)
    _prefill(s, 50, {"a": [60, 61, 62, 63]})
    out = s.schedule()  # verifies 50 at 6, then 60..63 at 7..10
    s.update_from_output(out, {"a": [90]}, {})  # all four rejected
    assert r.num_computed_tokens == 7  # positions 0..6: block 1 is not complete
    pool = s.kv_cache.pool
    hashes = []
    extend_block_hashes(hashes, r.all_token_ids, 4)
    assert pool.lookup((0, hashes[0])) is not None
    assert len(hashes) == 2 and pool.lookup((0, hashes[1])) is None  # [5, 6, 50, 90]: position 7 not yet computed
    rejected = []
    extend_block_hashes(rejected, [1, 2, 3, 4, 5, 6, 50, 60, 61, 62, 63], 4)
    assert all(pool.lookup((0, h)) is None for h in rejected[1:])


def test_accepted_proposals_that_complete_a_block_cache_it_the_same_step():
    s = _scheduler(FixedPolicy(3))
    r = _request("a", [1, 2, 3, 4, 5, 6], max_tokens=4)
    s.add_request(r)
    _prefill(s, 50, {"a": [60, 61, 62]})
    out = s.schedule()
    # Only two proposals fit max_tokens (4): 50 at 6, 60 at 7, 61 at 8; all accepted + 99 = 4 tokens.
    assert out.chunks[0].num_spec_tokens == 2
    s.update_from_output(out, {"a": [60, 61, 99]}, {})
    assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == [50, 60, 61, 99]
    hashes = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 50, 60, 61], 4)
    assert s.kv_cache.pool.lookup((0, hashes[1])) is not None  # positions 4..7 computed and accepted
    assert s.kv_cache.usage == 0.0


def test_a_stop_token_inside_the_accepted_run_ends_the_request_there():
    s = _scheduler(FixedPolicy(3))
    r = _request("a", [1, 2, 3])
    s.add_request(r)
    _prefill(s, 50, {"a": [60, EOS, 62]})
    out = s.schedule()
    produced = s.update_from_output(out, {"a": [60, EOS, 62, 63]}, {"a": [1]})
    assert produced == [(r, 2)]  # 60 and EOS; 62 and 63 are dropped
    assert r.output_token_ids == [50, 60, EOS] and r.status is RequestStatus.FINISHED_STOPPED
    assert r.spec_token_ids == [] and s.kv_cache.usage == 0.0


def test_min_tokens_holds_eos_inside_an_accepted_run():
    s = _scheduler(FixedPolicy(3))
    r = _request("a", [1, 2, 3], min_tokens=3)
    s.add_request(r)
    _prefill(s, EOS, {"a": [EOS, 7, EOS]})
    s.update_from_output(s.schedule(), {"a": [EOS, 7, EOS]}, {})
    assert r.output_token_ids == [EOS, EOS, 7, EOS] and r.status is RequestStatus.FINISHED_STOPPED


def test_requests_without_proposals_share_the_step_with_speculating_ones():
    s = _scheduler(FixedPolicy(2))
    a, b = _request("a", [1, 2, 3]), _request("b", [7, 8, 9])
    s.add_request(a)
    s.add_request(b)
    _prefill(s, 50, {"a": [60, 61]})  # nothing proposed for b
    out = s.schedule()
    assert [(c.request_id, c.num_spec_tokens, c.num_tokens) for c in out.chunks] == [("a", 2, 3), ("b", 0, 1)]
    produced = s.update_from_output(out, {"a": [60, 61, 62], "b": [51]}, {})
    assert produced == [(a, 3), (b, 1)]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (6, 4)


def test_the_token_budget_caps_the_proposals():
    s = _scheduler(FixedPolicy(4), budget=3)
    r = _request("a", [1, 2])
    s.add_request(r)
    _prefill(s, 50, {"a": [60, 61, 62, 63]})
    out = s.schedule()
    assert out.chunks[0].token_ids == [50, 60, 61] and out.num_batched_tokens == 3


def test_a_model_proposer_gets_slots_for_its_lookahead():
    s = _scheduler(FixedPolicy(5, reserves_kv_slots=True))
    r = _request("a", [1, 2, 3])
    s.add_request(r)
    out = s.schedule()
    # Positions 0..2 computed now, then the sampled token and 4 more proposals' KV: 8 slots, 2 blocks.
    assert out.chunks[0].num_lookahead_tokens == 5
    assert len(out.chunks[0].block_ids[0]) == 2


def test_proposals_never_preempt_and_give_way_when_the_pool_is_full():
    s = _scheduler(FixedPolicy(4), blocks=2, block_size=4)
    a, b = _request("a", [1, 2, 3], max_tokens=6), _request("b", [4, 5, 6], max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    _prefill(s, 50, {"a": [60, 61, 62, 63], "b": [64, 65, 66, 67]})
    out = s.schedule()  # each holds 1 block; proposals would need a second block each
    assert [c.num_spec_tokens for c in out.chunks] == [0, 0] and out.preempted_request_ids == []


def test_preemption_drops_the_proposals():
    s = _scheduler(FixedPolicy(1), blocks=3, block_size=4)
    a, b = _request("a", [1, 2, 3, 4], max_tokens=4), _request("b", [5, 6, 7, 8], max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    _prefill(s, 50, {"a": [60], "b": [61]})
    out = s.schedule()  # position 4 needs a second block each, one is left: b is preempted
    assert out.preempted_request_ids == ["b"] and b.spec_token_ids == []
    assert [c.request_id for c in out.chunks] == ["a"]
