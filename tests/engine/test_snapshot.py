"""The live page's snapshot (engine/snapshot.py): the KV grid it derives matches the block pool
exactly (owners, sharing, cached-free and free blocks) under n > 1, prefix hits and sliding
windows; the step log adds up to the engine's own counters; the feed builds nothing unasked and
an idle engine answers an ask."""

from __future__ import annotations

import asyncio

import pytest
import torch
from live_server import wait_until
from tiny_models import make_tiny_model

from kvflow import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from kvflow.core.kv_cache_manager import NULL_BLOCK
from kvflow.core.sched_output import ScheduledChunk, SchedulerOutput
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.snapshot import CACHED_FREE, FREE, HELD, SHARED, SnapshotFeed, StepLog, derive_grid, take_snapshot

BLOCK = 4


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _params(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=7, n=n, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for name in ("llama-mha-tied", "qwen2-hybrid-window"):  # one KV group; a full and a sliding group
        dirs[name] = tmp_path_factory.mktemp(name)
        make_tiny_model(name, dirs[name])
    return dirs


def _engine(model_dir, **kw) -> LLMEngine:
    args = dict(model=str(model_dir), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK,
                num_kv_blocks=96, disable_log_stats=True)
    return LLMEngine(EngineArgs(**{**args, **kw}))


def _expected_blocks(engine: LLMEngine) -> tuple[list[int], dict[int, list[str]]]:
    """From the pool and the tables themselves: each block's state, and who holds it."""
    kv = engine.scheduler.kv_cache
    pool = kv.pool
    free = set(pool._free)
    states = []
    for b in range(pool.num_blocks):
        if b in free:
            states.append(CACHED_FREE if pool.block_hashes[b] else FREE)
        else:
            states.append(SHARED if pool.ref_counts[b] > 1 else HELD)
    holders: dict[int, list[str]] = {}
    for rid, tables in kv.all_block_tables():
        for table in tables:
            for b in table:
                if b != NULL_BLOCK:
                    holders.setdefault(b, []).append(rid)
    return states, holders


def _check_grid(engine: LLMEngine) -> dict[int, int]:
    """The grid derived from a snapshot against the live pool; returns the count of each state."""
    snapshot = take_snapshot(engine.scheduler, engine.get_stats(), None, 1)
    grid = derive_grid(snapshot)
    states, holders = _expected_blocks(engine)
    assert grid.state.tolist() == states
    names = [rid for rid, _ in snapshot.holders]
    for b in range(snapshot.num_blocks):
        want = holders.get(b, [])
        assert len(want) == engine.scheduler.kv_cache.pool.ref_counts[b]  # the pool's count is the tables'
        assert grid.ref_counts[b] == len(want)
        assert (names[grid.owner[b]] if grid.owner[b] >= 0 else None) == (want[0] if want else None)
        assert [names[i] for i in grid.owners.get(b, [])] == (want if len(want) > 1 else []), b
    pool = engine.scheduler.kv_cache.pool
    assert grid.hashed.tolist() == [bool(h) for h in pool.block_hashes]
    assert grid.unaccounted == []
    assert grid.count(FREE) + grid.count(CACHED_FREE) == pool.num_free_blocks
    return {s: grid.count(s) for s in (FREE, CACHED_FREE, HELD, SHARED)}


def _step_checking(engine: LLMEngine) -> list[dict[int, int]]:
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append(_check_grid(engine))
    return seen


def test_n_siblings_and_prefix_hits_share_exactly_the_blocks_the_pool_says(model_dirs):
    engine = _engine(model_dirs["llama-mha-tied"])
    system = _tokens(14, 1)
    engine.add_request("a", system + _tokens(3, 2), _params(9, n=3))  # siblings share the prompt
    engine.step()  # a#0 computes the prompt; its siblings wait for its blocks
    assert _check_grid(engine)[SHARED] == 0
    engine.step()
    # The prompt's full blocks are shared (each sibling writes its own tail block).
    assert _check_grid(engine)[SHARED] == len(system + _tokens(3, 2)) // BLOCK
    snapshot = take_snapshot(engine.scheduler, engine.get_stats(), None, 1)
    grid = derive_grid(snapshot)
    names = [rid for rid, _ in snapshot.holders]
    shared = [b for b, s in enumerate(grid.state) if s == SHARED]
    assert all(sorted(names[i] for i in grid.owners[b]) == ["a#0", "a#1", "a#2"] for b in shared)
    engine.add_request("b", system + _tokens(6, 3), _params(5))  # finds the system prompt's 3 full blocks
    engine.add_request("c", _tokens(10, 4), _params(4))  # shares nothing
    seen = _step_checking(engine)
    assert max(s[SHARED] for s in seen) >= 4
    assert seen[-1][HELD] == seen[-1][SHARED] == 0 and seen[-1][CACHED_FREE] > 0  # all done: cached, not held
    assert engine.get_stats().prefix_cache_hits_total > 0


def test_sliding_window_groups_and_given_back_blocks_are_counted_exactly(model_dirs):
    engine = _engine(model_dirs["qwen2-hybrid-window"], max_model_len=128)
    prompt = _tokens(30, 5)  # longer than the window (10): blocks leave it while the request runs
    engine.add_request("x", prompt, _params(12, n=2))
    engine.add_request("y", prompt[:20] + _tokens(4, 6), _params(6))
    seen = _step_checking(engine)
    assert any(s[SHARED] for s in seen)


def test_a_hybrids_state_slots_are_not_shown_as_blocks(tmp_path):
    """A hybrid's (Bamba's) state-group tables hold state slots, not blocks of the pool: the grid
    shows the attention blocks alone, every one of them accounted for."""
    from tiny_hybrid_models import make_tiny_bamba

    make_tiny_bamba("bamba-g1", tmp_path)
    engine = _engine(tmp_path, enable_prefix_caching=False)
    for i in range(3):
        engine.add_request(str(i), _tokens(9 + i, i), _params(4))
    engine.step()
    snapshot = take_snapshot(engine.scheduler, engine.get_stats(), None, 1)
    grid = derive_grid(snapshot)
    held = {b for _, groups in snapshot.holders for table in groups for b in table if b != NULL_BLOCK}
    assert grid.unaccounted == []
    assert grid.count(HELD) + grid.count(SHARED) == len(held) == engine.scheduler.kv_cache.pool.num_blocks - \
        engine.scheduler.kv_cache.pool.num_free_blocks > 0


def test_a_grid_that_miscounted_sharing_would_be_caught(model_dirs):
    """The checks above compare against the pool, not against the snapshot's own arithmetic."""
    engine = _engine(model_dirs["llama-mha-tied"])
    engine.add_request("a", _tokens(9, 8), _params(3, n=2))
    engine.step()
    snapshot = take_snapshot(engine.scheduler, engine.get_stats(), None, 1)
    tampered = [*snapshot.ref_counts[:1], snapshot.ref_counts[1] + 1, *snapshot.ref_counts[2:]]
    grid = derive_grid(type(snapshot)(**{**snapshot.__dict__, "ref_counts": tampered}))
    assert grid.unaccounted == [1]


def _chunk(rid: str, tokens: int, spec: int = 0, sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(rid, [1] * tokens, 0, ([],), sample, SamplingParams(), [1], [], frozenset(),
                          num_spec_tokens=spec)


def test_a_step_record_splits_the_budget_by_what_it_was_spent_on():
    sched = SchedulerOutput(preempted_request_ids=["gone"])
    for chunk in (_chunk("d", 1), _chunk("s", 4, spec=3), _chunk("p", 40, sample=False), _chunk("q", 7)):
        sched.add(chunk)
    log = StepLog()
    log.begin(budget=64)
    log.land(sched, {"d": [5], "s": [5, 6], "q": [9]})  # s: one of its 3 proposals kept
    record = log.records[-1]
    assert (record.decode_tokens, record.prefill_tokens, record.spec_accepted, record.spec_rejected) == (2, 47, 1, 2)
    assert (record.budget, record.num_preempted, record.num_requests) == (64, 1, 4)
    assert record.decode_tokens + record.prefill_tokens + record.spec_accepted + record.spec_rejected == 52


def test_the_step_log_adds_up_to_the_engines_counters_with_speculation(model_dirs):
    engine = _engine(model_dirs["llama-mha-tied"], enable_prefix_caching=False, speculative_config=dict(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False))
    engine.step_log = StepLog(maxlen=10_000)
    prompts = [_tokens(5, 9) * 4, _tokens(7, 10) * 3, _tokens(11, 11)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, _params(20))
    while engine.has_unfinished_requests():
        engine.step()
    records, spec = engine.step_log.records, engine.get_stats().spec_decoding
    assert sum(r.spec_accepted for r in records) == spec.num_accepted_tokens
    assert sum(r.spec_accepted + r.spec_rejected for r in records) == spec.num_draft_tokens > 0
    assert sum(r.prefill_tokens for r in records) == sum(map(len, prompts))
    # A prompt's chunk samples each request's first token; every later one is a decode's or an accepted proposal.
    assert sum(r.decode_tokens + r.spec_accepted for r in records) == engine.get_stats().generation_tokens_total - len(prompts)
    assert sum(r.num_preempted for r in records) == engine.get_stats().num_preemptions_total


class _Engine:
    def __init__(self, engine: LLMEngine) -> None:
        self.scheduler, self.step_log = engine.scheduler, None


def test_the_feed_builds_nothing_unasked_and_at_most_once_per_ask(model_dirs):
    engine = _Engine(_engine(model_dirs["llama-mha-tied"]))
    feed = SnapshotFeed(linger_s=3600, min_interval_s=0.0)
    stats = object()
    feed.serve(engine, stats)
    assert feed.latest is None and engine.step_log is None  # nobody asked: nothing built, nothing recorded
    assert feed.ask() is None
    feed.serve(engine, stats)
    first = feed.latest
    assert first.seq == 1 and first.stats is stats and engine.step_log is not None
    feed.serve(engine, stats)
    assert feed.latest is first  # not asked again: the same object, nothing rebuilt
    assert feed.ask() is first
    feed.serve(engine, stats)
    assert feed.latest.seq == 2
    feed.linger_s = 0.0
    feed.serve(engine, stats)
    assert engine.step_log is None  # nobody looked for linger_s: steps are no longer recorded


def test_an_idle_engine_answers_an_ask_with_its_current_state(model_dirs):
    """Without the wake-up an idle engine would sit on its queue and the asks would go unanswered."""
    llm = AsyncLLM(_engine(model_dirs["llama-mha-tied"]))
    try:
        assert wait_until(lambda: llm.latest_snapshot() is not None, timeout=30)

        async def run() -> None:
            async for _ in llm.generate({"prompt_token_ids": _tokens(9, 12)}, _params(4, n=2), "r"):
                pass

        asyncio.run(run())

        def finished() -> bool:
            s = llm.latest_snapshot()
            return s.stats.generation_tokens_total == 4 * 2 and not s.running and not s.holders  # max_tokens x n

        assert wait_until(finished, timeout=30), llm.latest_snapshot()
        done = llm.latest_snapshot()
        assert done.stats == llm.get_stats()
        assert derive_grid(done).count(CACHED_FREE) > 0
    finally:
        llm.shutdown()


def test_however_fast_viewers_poll_a_snapshot_is_taken_at_most_once_per_interval(model_dirs):
    engine = _Engine(_engine(model_dirs["llama-mha-tied"]))
    feed = SnapshotFeed(linger_s=3600, min_interval_s=3600)
    feed.ask()
    feed.serve(engine, object())
    first = feed.latest
    for _ in range(5):  # asks within the interval: the same snapshot, nothing asked of the engine
        assert feed.ask() is first and not feed.wanted
        feed.serve(engine, object())
    assert feed.latest is first
    feed.min_interval_s = 0.0
    assert feed.ask() is first and feed.wanted  # once it is old enough, the next step publishes anew
    feed.serve(engine, object())
    assert feed.latest.seq == 2
