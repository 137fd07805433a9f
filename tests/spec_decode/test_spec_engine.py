"""Speculative decoding in the engine, with tiny random models (float32): greedy output is the
non-speculative output token for token whatever the proposer, the batch or the memory pressure;
a draft identical to the target accepts everything; seeded sampling reproduces; logprobs, stops,
prefix caching and KV accounting behave as without speculation."""

from __future__ import annotations

import pytest
import torch
from tiny_models import COMMON, make_tiny_model

from kvflow import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft")
    make_tiny_model("llama-gqa-llama3-rope", path, seed=1)  # same vocabulary, other weights
    return str(path)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def prompts():
    # Repeated text gives the n-gram proposer something to find.
    return [_tokens(n, n) * reps for n, reps in ((1, 1), (9, 3), (16, 1), (31, 2), (50, 1), (23, 3))]


def _mixed_params() -> list[SamplingParams]:
    """One request per prompt, each exercising something the verifier must reproduce."""
    return [GREEDY, GREEDY.clone(repetition_penalty=1.3, frequency_penalty=0.5), GREEDY.clone(logprobs=3),
            GREEDY.clone(min_tokens=20, ignore_eos=False, stop_token_ids=[5, 17]), GREEDY.clone(max_tokens=7),
            GREEDY.clone(presence_penalty=1.0, max_tokens=30)]


def _llm(target_dir, spec=None, **kw) -> LLM:
    return LLM(target_dir, dtype="float32", skip_tokenizer_init=True, disable_log_stats=True,
               speculative_config=spec, **kw)


def _spec(method: str, target_dir: str, other_dir: str, k: int = 3, **kw) -> dict:
    extra = {"ngram": dict(prompt_lookup_min=1), "layer_skip": dict(num_draft_layers=1),
             "draft_model": dict(model=other_dir), "same_draft": dict(model=target_dir)}[method]
    return dict(method="draft_model" if method == "same_draft" else method, num_speculative_tokens=k,
                adaptive=False, **extra, **kw)


def _outputs(llm: LLM, prompts, params) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def baseline(target_dir, prompts):
    return _outputs(_llm(target_dir, attention_backend="torch_reference"), prompts, _mixed_params())


SCENARIOS = {
    "roomy": dict(),
    # A budget below the prompts (chunked prefill sharing steps with verifications) and a pool
    # too small for everyone: preemption by recompute.
    "chunked, preempted": dict(max_num_batched_tokens=13, num_kv_blocks=13, block_size=8),
    # Preemption by swapping under the priority policy, one request at the top.
    "swapped, priority": dict(num_kv_blocks=13, block_size=8, preemption_mode="swap", scheduling_policy="priority"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft_model", "same_draft"])
def test_greedy_output_is_the_non_speculative_output(target_dir, other_dir, prompts, baseline, method, scenario):
    llm = _llm(target_dir, _spec(method, target_dir, other_dir), **SCENARIOS[scenario])
    got = _outputs(llm, prompts, _mixed_params())
    assert [o.token_ids for o in got] == [o.token_ids for o in baseline]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in baseline]
    engine = llm.llm_engine
    assert engine.kv_cache_usage == 0.0
    stats = engine.get_stats().spec_decoding
    assert stats.num_draft_tokens > 0
    if scenario != "roomy":
        assert engine.scheduler.num_preemptions_total > 0
    if method == "same_draft":  # its drafts ignore penalties and bans, the target does not
        assert stats.num_accepted_tokens > stats.num_draft_tokens / 2


def test_logprobs_are_the_non_speculative_logprobs(target_dir, prompts, baseline):
    llm = _llm(target_dir, _spec("same_draft", target_dir, ""))
    got = _outputs(llm, prompts, _mixed_params())[2]
    want = baseline[2]
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs) == 24
    for mine, theirs in zip(got.logprobs, want.logprobs):
        assert mine.keys() == theirs.keys()
        for token, lp in theirs.items():
            assert mine[token].rank == lp.rank and mine[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_equal_to_the_target_accepts_everything(target_dir, prompts, temperature):
    k = 3
    llm = _llm(target_dir, _spec("same_draft", target_dir, "", k=k))
    # 1 token from the prompt, then 4 verifications of k proposals + 1.
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=1 + 4 * (k + 1), ignore_eos=True)
    _outputs(llm, prompts, params)
    stats = llm.llm_engine.get_stats().spec_decoding
    assert stats.num_drafts == 4 * len(prompts)
    assert stats.num_accepted_tokens == stats.num_draft_tokens == 4 * k * len(prompts)
    assert stats.mean_acceptance_length == k + 1


@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft_model"])
def test_seeded_sampling_reproduces_alone_or_batched(target_dir, other_dir, prompts, method):
    params = SamplingParams(temperature=0.8, top_k=40, seed=11, max_tokens=20, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    spec = _spec(method, target_dir, other_dir)
    alone = _outputs(_llm(target_dir, spec), prompts[3], params)[0].token_ids
    batched = _outputs(_llm(target_dir, spec), prompts, [others, others, others, params, others, others])[3].token_ids
    again = _outputs(_llm(target_dir, spec), prompts[3], params)[0].token_ids
    assert alone == batched == again
    assert _outputs(_llm(target_dir, spec), prompts[3], params.clone(seed=12))[0].token_ids != alone


def test_n_completions_are_distinct_and_reproducible(target_dir, prompts):
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=16, ignore_eos=True)
    spec = _spec("layer_skip", target_dir, "")
    first = [c.token_ids for c in _llm(target_dir, spec).generate(prompts[1], params, use_tqdm=False)[0].outputs]
    second = [c.token_ids for c in _llm(target_dir, spec).generate(prompts[1], params, use_tqdm=False)[0].outputs]
    assert first == second and len({tuple(t) for t in first}) == 3


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(target_dir, prompts, baseline):
    full = baseline[0].token_ids
    stop = full[6]
    cut = full[:full.index(stop) + 1]
    params = GREEDY.clone(stop_token_ids=[stop])
    llm = _llm(target_dir, _spec("same_draft", target_dir, "", k=4))
    out = _outputs(llm, prompts[:1], params)[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (cut, "stop", stop)
    assert llm.llm_engine.kv_cache_usage == 0.0


def test_prefix_cache_hits_after_speculation_equal_an_unspeculated_runs(target_dir, prompts):
    def turns(llm: LLM) -> list[int]:
        history, cached = list(prompts[3]), []
        for turn in range(3):
            out = llm.generate([history], GREEDY.clone(max_tokens=13), use_tqdm=False)[0]
            cached.append(out.num_cached_tokens)
            history += out.outputs[0].token_ids + _tokens(5, 90 + turn)
        return cached

    plain = turns(_llm(target_dir, block_size=4))
    speculated = turns(_llm(target_dir, _spec("same_draft", target_dir, "", k=4), block_size=4))
    assert speculated == plain and plain[1] > 0


@pytest.mark.parametrize("bad, message", [
    ({"num_speculative_tokens": 3}, "needs 'method'"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}, "unknown key 'speculative_model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model must be"),
    ({"method": "layer_skip", "num_speculative_tokens": 2}, "num_draft_layers must be given"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_draft_layers": 1}, "num_draft_layers must be given"),
    ({"method": "layer_skip", "num_speculative_tokens": 2, "num_draft_layers": 9}, "exceeds the model's 2 layers"),
    ('{"method": "ngram", ', "not valid JSON"),
])
def test_a_bad_speculative_config_is_refused_naming_the_key(target_dir, bad, message):
    with pytest.raises(ValueError, match=message):
        _llm(target_dir, bad)


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", 61, "vocabulary \\(61 tokens\\) differs from the target's \\(97\\)"),
    ("max_position_embeddings", 128, "context \\(128 tokens\\) is shorter than max_model_len \\(512\\)"),
])
def test_a_draft_model_that_does_not_fit_the_target_is_refused(target_dir, tmp_path, field, value, message):
    import transformers

    config = transformers.LlamaConfig(**{**COMMON, field: value, "num_attention_heads": 4, "num_key_value_heads": 2})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        _llm(target_dir, {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})
