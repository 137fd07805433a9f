"""Prefix caching, shared blocks and memory pressure: outputs never change, accounting is exact."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    make_tiny_model("mistral-window", path)  # sliding window: cached blocks must respect it too
    return str(path)


def _engine(model_dir, **kw) -> LLMEngine:
    args = dict(model=model_dir, dtype="float32", skip_tokenizer_init=True, block_size=BLOCK, disable_log_stats=True)
    return LLMEngine(EngineArgs(**{**args, **kw}))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: LLMEngine, prompts, params=GREEDY, one_by_one: bool = False) -> dict[str, object]:
    """Submit prompts (all at once, or each after the previous finished); outputs by request id."""
    outputs = {}
    batches = [[i] for i in range(len(prompts))] if one_by_one else [list(range(len(prompts)))]
    for batch in batches:
        for i in batch:
            engine.add_request(str(i), prompts[i], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
    return outputs


def _same_outputs(model_dir, prompts, one_by_one=True, **kw):
    on = _run(_engine(model_dir, **kw), prompts, one_by_one=one_by_one)
    off = _run(_engine(model_dir, enable_prefix_caching=False, **kw), prompts, one_by_one=one_by_one)
    assert [on[str(i)].outputs[0].token_ids for i in range(len(prompts))] == \
           [off[str(i)].outputs[0].token_ids for i in range(len(prompts))]
    return on


def test_shared_system_prompt(model_dir):
    system = _tokens(40, 1)
    prompts = [system + _tokens(5 + i, 100 + i) for i in range(6)]
    on = _same_outputs(model_dir, prompts)
    # 40 shared tokens = 2 full blocks of 16; the first request finds nothing.
    assert [on[str(i)].num_cached_tokens for i in range(6)] == [0] + [32] * 5


def test_multi_turn_conversation_extends_the_previous_turn(model_dir):
    engine = _engine(model_dir)
    history = _tokens(20, 2)
    cached = []
    for turn in range(4):
        out = _run(engine, [history], one_by_one=True)["0"]
        cached.append(out.num_cached_tokens)
        history = history + out.outputs[0].token_ids + _tokens(7, 50 + turn)
        engine_off = _engine(model_dir, enable_prefix_caching=False)
        assert _run(engine_off, [out.prompt_token_ids])["0"].outputs[0].token_ids == out.outputs[0].token_ids
    # Each turn reuses every full block the previous turn computed: its prompt and all of its
    # answer but the last token (sampled, never fed back). Prompts: 20, 39, 58, 77 tokens.
    lengths = [20 + 19 * t for t in range(4)]
    assert cached == [0] + [(prev + 12 - 1) // BLOCK * BLOCK for prev in lengths[:-1]] == [0, 16, 48, 64]


def test_prefix_ending_mid_block_and_exact_duplicates(model_dir):
    base = _tokens(37, 3)  # 2 full blocks + 5 tokens
    prompts = [base, base[:30] + _tokens(9, 4), base, base[:37]]
    on = _same_outputs(model_dir, prompts)
    # A partial shared prefix counts whole blocks; a prompt found whole recomputes only its last token.
    assert [on[str(i)].num_cached_tokens for i in range(4)] == [0, 16, 36, 36]


def test_whole_prompt_cached_recomputes_only_the_last_token(model_dir):
    prompt = _tokens(48, 5)  # exactly 3 blocks
    on = _same_outputs(model_dir, [prompt, prompt])
    assert on["1"].num_cached_tokens == 47  # the last token is computed (in a copy of its block) for logits


def test_accounting_counters_are_exact(model_dir):
    engine = _engine(model_dir)
    system = _tokens(35, 6)
    prompts = [system + _tokens(4, 200 + i) for i in range(3)]
    _run(engine, prompts, one_by_one=True)
    stats = engine.get_stats()
    assert stats.prefix_cache_queries_total == 3 * 39
    assert stats.prefix_cache_hits_total == 2 * 32
    assert stats.prompt_tokens_total == 3 * 39 and stats.generation_tokens_total == 3 * 12


def test_evicted_blocks_are_recomputed_correctly(model_dir):
    # 8 blocks: each request needs 4, so later requests evict earlier ones' cached blocks.
    prompts = [_tokens(40, 10 + i % 3) for i in range(7)]
    _same_outputs(model_dir, prompts, num_kv_blocks=8)


def test_preemption_then_readmission_uses_the_cache(model_dir):
    prompts = [_tokens(30, 20 + i) for i in range(5)]
    on = _engine(model_dir, num_kv_blocks=7)
    got = _run(on, prompts, one_by_one=False)
    assert on.scheduler.num_preemptions_total > 0
    assert on.get_stats().prefix_cache_hits_total > 0  # re-admitted requests found their own blocks
    ref = _run(_engine(model_dir, enable_prefix_caching=False), prompts, one_by_one=False)
    assert [got[str(i)].outputs[0].token_ids for i in range(5)] == [ref[str(i)].outputs[0].token_ids for i in range(5)]
    assert on.kv_cache_usage == 0.0


def test_n4_shares_the_prompt_blocks_and_matches_seeded_singles(model_dir):
    engine = _engine(model_dir)
    prompt = _tokens(64, 30)  # 4 full blocks
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=77, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("p", prompt, params)
    peak = 0
    result = None
    while engine.has_unfinished_requests():
        used = engine.scheduler.kv_cache.num_blocks - engine.scheduler.kv_cache.pool.num_free_blocks
        peak = max(peak, used)
        for out in engine.step():
            result = out
        peak = max(peak, engine.scheduler.kv_cache.num_blocks - engine.scheduler.kv_cache.pool.num_free_blocks)
    # The prompt's 4 blocks once; each sibling copies only the block it recomputes the last prompt
    # token in, and each child adds one block for its 8 new tokens.
    assert peak <= 4 + 3 + 4
    assert engine.get_stats().prefix_cache_hits_total == 3 * 63  # siblings reuse all but the last token
    for c in result.outputs:
        single = _run(_engine(model_dir), [prompt], params.clone(n=1, seed=77 + c.index))["0"]
        assert c.token_ids == single.outputs[0].token_ids


def test_swap_mode_outputs_identical_to_unpreempted(model_dir):
    prompts = [_tokens(30, 40 + i) for i in range(5)]
    swap = _engine(model_dir, num_kv_blocks=7, preemption_mode="swap", swap_space_gb=0.01)
    got = _run(swap, prompts)
    assert swap.scheduler.num_preemptions_total > 0
    ref = _run(_engine(model_dir), prompts)
    assert [got[str(i)].outputs[0].token_ids for i in range(5)] == [ref[str(i)].outputs[0].token_ids for i in range(5)]
    assert swap.kv_cache_usage == 0.0 and swap.scheduler.host_pool.num_free_blocks == swap.scheduler.host_pool.num_blocks


def test_high_priority_request_runs_first_when_the_pool_is_full(model_dir):
    # The window (12) bounds each request's blocks: 3 blocks hold one request at a time.
    engine = _engine(model_dir, num_kv_blocks=3, scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(3):
        engine.add_request(f"low{i}", _tokens(30, 60 + i), params, priority=5)
    engine.step()
    engine.step()
    engine.add_request("high", _tokens(30, 70), params, priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished[0] == "high"
    assert engine.scheduler.num_preemptions_total > 0


@pytest.mark.parametrize("mode,policy", [("recompute", "fcfs"), ("swap", "fcfs"), ("recompute", "priority"),
                                         ("swap", "priority")])
def test_no_deadlock_with_a_pool_of_a_few_blocks(model_dir, mode, policy):
    engine = _engine(model_dir, num_kv_blocks=3, block_size=16, preemption_mode=mode, swap_space_gb=0.01,
                     scheduling_policy=policy, max_num_batched_tokens=16)
    prompts = [_tokens(10 + 5 * i, 80 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, priority=i % 3)
    steps, done = 0, 0
    while engine.has_unfinished_requests():
        done += sum(o.finished for o in engine.step())
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
    assert done == 6 and engine.kv_cache_usage == 0.0


def test_reset_prefix_cache_forgets_free_blocks_only(model_dir):
    engine = _engine(model_dir)
    prompt = _tokens(40, 90)
    _run(engine, [prompt])
    engine.reset_prefix_cache()
    assert engine.scheduler.kv_cache.find_cached_prefix(_request_like(prompt)) == (([],), 0)
    assert _run(engine, [prompt])["0"].num_cached_tokens == 0


def _request_like(tokens: list[int]):
    from kvflow.core.request import Request

    return Request("probe", tokens, GREEDY, 1, frozenset())


def test_prompt_logprobs_are_complete_even_when_the_prompt_is_cached(model_dir):
    engine = _engine(model_dir)
    prompt = _tokens(40, 95)
    params = GREEDY.clone(prompt_logprobs=1)
    first = _run(engine, [prompt], params)["0"]
    second = _run(engine, [prompt], params)["0"]  # its blocks are all in the cache now
    assert second.num_cached_tokens == 0 and engine.get_stats().prefix_cache_queries_total == 0  # no lookup made
    assert second.prompt_logprobs[0] is None and all(lp is not None for lp in second.prompt_logprobs[1:])
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:]):
        assert {t: round(lp.logprob, 4) for t, lp in a.items()} == {t: round(lp.logprob, 4) for t, lp in b.items()}
