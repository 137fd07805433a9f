"""The engine's public behaviour: output shapes, n > 1, seeds, streaming deltas, abort, bad input."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    make_tiny_model("qwen2-bias", path)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256, num_kv_blocks=64)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drain(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


def test_request_output_shape(llm):
    out = llm.generate([_prompt(5)], SamplingParams(max_tokens=6, logprobs=2, seed=1), use_tqdm=False)[0]
    c = out.outputs[0]
    assert out.prompt_token_ids == _prompt(5) and out.finished
    assert len(c.token_ids) == 6 and c.finish_reason == "length" and c.index == 0
    assert len(c.logprobs) == 6 and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
    assert all(len(lp) in (2, 3) for lp in c.logprobs)  # the sampled token plus the top 2 (may overlap)
    assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)), abs=1e-5)
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234)
    alone = llm.generate([_prompt(8)], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [_prompt(n, seed=n) for n in (3, 20, 11)]
    noisy = SamplingParams(temperature=1.0, max_tokens=7)
    mixed = llm.generate(others[:2] + [_prompt(8)] + others[2:], [noisy, noisy, params, noisy], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    different = llm.generate([_prompt(8)], params.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert different != alone  # the seed matters (12 tokens from a 97-token vocabulary)


def test_seeds_that_differ_only_above_bit_32_draw_differently(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    draws = [llm.generate([_prompt(8)], params.clone(seed=seed), use_tqdm=False)[0].outputs[0].token_ids
             for seed in (1234, 1234 + 2**32, 1234 + 2**40, 1234 - 2**63)]
    assert len({tuple(d) for d in draws}) == 4  # (12 tokens from a 97-token vocabulary)


def test_n_completions_each_equal_a_seeded_single_request(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=10)
    out = llm.generate([_prompt(6)], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        single = llm.generate([_prompt(6)], params.clone(n=1, seed=10 + c.index), use_tqdm=False)[0]
        assert c.token_ids == single.outputs[0].token_ids


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate([_prompt(4)], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    out = llm.generate([_prompt(4)], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)


def test_delta_outputs_concatenate_to_the_final_output(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True))
    engine.add_request("d", _prompt(5), SamplingParams(temperature=0, max_tokens=9, output_kind=RequestOutputKind.DELTA))
    deltas = [o.outputs[0].token_ids for o in _drain(engine)]
    engine.add_request("f", _prompt(5), SamplingParams(temperature=0, max_tokens=9, output_kind=RequestOutputKind.FINAL_ONLY))
    finals = _drain(engine)
    assert len(finals) == 1 and all(len(d) == 1 for d in deltas)
    assert sum(deltas, []) == finals[0].outputs[0].token_ids


def test_abort_frees_blocks_and_leaves_others_untouched(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True))
    params = SamplingParams(temperature=0, max_tokens=10, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("keep", _prompt(12), params)
    expected = _drain(engine)[0].outputs[0].token_ids
    engine.add_request("keep2", _prompt(12), params)
    engine.add_request("drop", _prompt(30, seed=3), params)
    engine.step()
    aborted = engine.abort_request("drop")
    assert aborted[0].outputs[0].finish_reason == "abort"
    assert _drain(engine)[0].outputs[0].token_ids == expected
    assert engine.kv_cache_usage == 0.0


BAD_REQUESTS = [
    ([], SamplingParams(), "prompt is empty"),
    ([5, 97], SamplingParams(), r"token id 97 is not an integer in \[0, 97\)"),
    ([5, -1], SamplingParams(), "token id -1"),
    ([5, "x"], SamplingParams(), "token id 'x'"),
    (_prompt(250), SamplingParams(max_tokens=10),
     r"prompt \(250 tokens\) \+ max_tokens \(10\) = 260 tokens exceeds max_model_len \(256\)"),
    (_prompt(300), SamplingParams(max_tokens=None), r"exceeds max_model_len \(256\)"),
    ("text without a tokenizer", SamplingParams(), "need a tokenizer"),
    ({"neither": 1}, SamplingParams(), "needs 'prompt' or 'prompt_token_ids'"),
]


@pytest.mark.parametrize("prompt,params,message", BAD_REQUESTS)
def test_bad_request_is_refused_and_others_are_unaffected(model_dir, prompt, params, message):
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256))
    good = SamplingParams(temperature=0, max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("good", _prompt(9), good)
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    outs = _drain(engine)
    assert [o.request_id for o in outs] == ["good"] and len(outs[0].outputs[0].token_ids) == 6
    assert engine.kv_cache_usage == 0.0


def test_request_larger_than_the_whole_cache_is_refused(model_dir):
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="needs 3 KV blocks .* has 2; raise num_kv_blocks or lower max_tokens"):
        llm.generate([_prompt(8)], SamplingParams(max_tokens=4))  # the setting that sized this pool


def test_llm_generate_refuses_the_whole_batch_and_names_the_prompt(llm):
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate([_prompt(3), []], SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()


def test_duplicate_request_id_is_refused(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True))
    engine.add_request("x", _prompt(3), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", _prompt(3), SamplingParams(max_tokens=2))


def test_warm_up_leaves_no_trace(model_dir):
    def engine():
        return LLMEngine(EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                                    num_kv_blocks=64, max_num_batched_tokens=96))

    cold, warm = engine(), engine()
    warm.warm_up()
    stats = warm.get_stats()
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (0, 0)
    assert (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total) == (0, 0)
    pool = warm.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.cached  # its 96 tokens' blocks are back, uncached
    params = SamplingParams(max_tokens=8, temperature=0)
    for e in (cold, warm):
        e.add_request("r", {"prompt_token_ids": [0] * 40 + _prompt(9)}, params)  # would hit its blocks if cached
    outs = [_drain(e)[-1] for e in (cold, warm)]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert warm.get_stats().prefix_cache_hits_total == 0


def _steps_and_tokens(engine: LLMEngine, seed: int = 0) -> tuple[int, list[int]]:
    """Steps and tokens of a 100-token prompt (another `seed`: no prefix in the cache) to 4 tokens."""
    engine.add_request(f"r{seed}", {"prompt_token_ids": _prompt(100, seed)}, SamplingParams(max_tokens=4, temperature=0))
    steps, outs = 0, []
    while engine.has_unfinished_requests():
        steps += 1
        outs.extend(engine.step())
    return steps, outs[-1].outputs[0].token_ids


def _budget_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                                num_kv_blocks=64, max_num_batched_tokens=128))


def test_a_set_token_budget_chunks_prompts_by_it_and_leaves_outputs_as_they_were(model_dir):
    """After set_token_budget(32) a 100-token prompt's prefill takes four steps instead of one, its
    tokens as before (float32); the budget never goes past the configured one."""
    wide, narrow = _budget_engine(model_dir), _budget_engine(model_dir)
    narrow.set_token_budget(32)
    assert narrow.config.scheduler.max_num_batched_tokens == narrow.scheduler.config.max_num_batched_tokens == 32
    (wide_steps, wide_tokens), (narrow_steps, narrow_tokens) = _steps_and_tokens(wide), _steps_and_tokens(narrow)
    assert narrow_steps - wide_steps == 3  # ceil(100 / 32) prefill steps instead of one
    assert narrow_tokens == wide_tokens
    narrow.set_token_budget(128)  # back up to the configured budget: allowed
    for bad in (0, 129):
        with pytest.raises(ValueError, match="max_num_batched_tokens=.*configured"):
            narrow.set_token_budget(bad)


def test_a_fitted_budget_follows_the_steps_it_sees(model_dir, monkeypatch):
    """With fit_token_budget on, steps slower than the target lower the budget for the steps after
    them (once the step-time model has seen steps of different sizes: the prompt's, its decodes');
    without it, the configured budget stays whatever the steps take."""
    from kvflow.engine import step_budget

    monkeypatch.setattr(step_budget, "STEP_TARGET_S", 1e-9)  # every step is too slow
    monkeypatch.setattr(step_budget, "MIN_BUDGET", 32)
    fitted, fixed = _budget_engine(model_dir), _budget_engine(model_dir)
    fitted.fit_token_budget()
    first = [_steps_and_tokens(e) for e in (fitted, fixed)]
    assert first[0] == first[1]  # set during the first prompt's decodes: nothing it ran changed
    assert fitted.config.scheduler.max_num_batched_tokens == 32 and fixed.config.scheduler.max_num_batched_tokens == 128
    (fitted_steps, fitted_tokens), (fixed_steps, fixed_tokens) = (_steps_and_tokens(e, seed=1) for e in (fitted, fixed))
    assert fitted_steps - fixed_steps == 3 and fitted_tokens == fixed_tokens


def test_a_fitted_budget_starts_at_the_warm_up_size_and_rises_when_steps_are_fast(model_dir, monkeypatch):
    """A step larger than the warm-up's would pay for what it builds and read as slow: the fitted
    budget starts at the warm-up's size and goes up to the configured one once fitted steps say so."""
    from kvflow.engine import llm_engine, step_budget

    monkeypatch.setattr(llm_engine, "WARM_UP_MAX_TOKENS", 64)
    monkeypatch.setattr(step_budget, "STEP_TARGET_S", 1e9)  # every step is fast
    engine = _budget_engine(model_dir)
    engine.fit_token_budget()
    assert engine.config.scheduler.max_num_batched_tokens == 64
    _steps_and_tokens(engine)
    assert engine.config.scheduler.max_num_batched_tokens == 128


@pytest.mark.parametrize("budget,full_step_s,fitted", [
    (1024, 0.22, 1024),  # the Xeon's full step: kept
    (1024, 0.55, 512),  # the EPYC's: halved, a step then ~0.28 s
    (1024, 1.7, 256),  # a third halving would reach 0.21 s, past the floor: stops at it
    (128, 9.0, 128),  # below the floor already: kept
    (1000, 0.9, 500),  # not a power of two: halved all the same
])
def test_the_fitted_budget_keeps_a_step_within_its_target(budget, full_step_s, fitted):
    from kvflow.engine.step_budget import MIN_BUDGET, STEP_TARGET_S, fitted_token_budget

    def step_s(n: int) -> float:
        return full_step_s * n / budget

    got = fitted_token_budget(budget, step_s)
    assert got == fitted
    assert got == budget or step_s(got) <= STEP_TARGET_S or got // 2 < MIN_BUDGET


def test_a_step_budget_follows_the_step_time_of_recent_steps():
    """Nothing until steps of different sizes were seen; then the budget a fitted T(n) = a + b·n
    allows, back up to the configured one once the steps run faster."""
    from kvflow.engine.step_budget import STEP_TARGET_S, StepBudget

    def slow(n: int) -> float:  # the EPYC's: 1,024 tokens in 0.55 s
        return 0.02 + 0.52 * n / 1024

    budget = StepBudget(1024)
    assert budget.observe(0, 0.0) is None and budget.observe(1024, slow(1024)) is None  # one size: no fit yet
    assert budget.observe(16, slow(16)) == 512 and slow(512) <= STEP_TARGET_S < slow(1024)
    for _ in range(300):  # the machine got faster (another tenant left): older steps fade out
        got = [budget.observe(n, 0.01 + 0.2 * n / 1024) for n in (16, 512)]
    assert got == [1024, 1024]


def test_warm_up_prompt_is_a_full_step_up_to_its_cap(model_dir, monkeypatch):
    """The warm-up's prompt fills a step, but never past WARM_UP_MAX_TOKENS (a server's start pays
    for its products)."""
    from kvflow.engine import llm_engine

    def warm_up_steps(budget: int) -> list[int]:
        engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                                      num_kv_blocks=64, max_num_batched_tokens=budget))
        schedule, steps = engine.scheduler.schedule, []

        def recorded(*args):
            out = schedule(*args)
            steps.append(out.num_batched_tokens)
            return out

        engine.scheduler.schedule = recorded
        engine.warm_up()
        return steps

    monkeypatch.setattr(llm_engine, "WARM_UP_MAX_TOKENS", 40)
    assert warm_up_steps(96)[0] == 40  # capped
    assert warm_up_steps(32)[0] == 32  # a full step below the cap


def test_warm_up_refuses_to_run_beside_requests(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                                  num_kv_blocks=64))
    engine.add_request("r", {"prompt_token_ids": _prompt(5)}, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="before any request"):
        engine.warm_up()
    assert len(_drain(engine)[-1].outputs[0].token_ids) == 2


def test_warm_up_fits_a_kv_pool_smaller_than_a_step(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                                  num_kv_blocks=4, max_num_batched_tokens=96))  # 64 tokens of KV, 96 a step
    engine.warm_up()  # a server with this pool must still start
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks and engine.get_stats().prompt_tokens_total == 0
    engine.add_request("r", {"prompt_token_ids": _prompt(30)}, SamplingParams(max_tokens=4))
    assert len(_drain(engine)[-1].outputs[0].token_ids) == 4


def test_warm_up_lays_out_the_panels_of_few_row_products(model_dir, monkeypatch):
    from kvflow.quant import panel_linear
    from kvflow.quant.packed_linear import GatedPair, PackedWeight

    if not panel_linear.available():
        pytest.skip("no AVX-512 BF16 here, or the kernel could not be built")
    # a full step of more rows than the kernel takes (as a server's 1,024 rows against 512): its
    # prompt lays out no panels
    monkeypatch.setattr(panel_linear, "MAX_ROWS", 64)
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256,
                                  num_kv_blocks=64, max_num_batched_tokens=96))
    model = engine.runner.model

    def held() -> list:
        found = []
        for module in model.modules():
            values = list(vars(module).values())
            pair = [v for v in values if isinstance(v, GatedPair)]
            # a [gate; up] layer's own packed copy is not multiplied once its pair exists
            found += pair or [v for v in values if isinstance(v, PackedWeight) and panel_linear.takes(16, v.main.shape)]
        return found

    assert held() and not any(p.panels is not None for p in held())  # laid out lazily
    engine.warm_up()
    pairs = [p for p in held() if isinstance(p, GatedPair)]
    assert pairs and all(p.panels is not None for p in held())  # every MLP's pair and every layer's panels
