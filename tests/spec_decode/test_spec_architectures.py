"""Speculation on the KV-shrinking architectures (float32, tiny random models): greedy output equals
the non-speculative output on Gemma 3 (sliding-window groups that give blocks back while a request
runs, so a rejected proposal's rollback must never need one), on MLA + mixture of experts and on a
plain mixture of experts; a draft model that needs several block tables is refused by name."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model

from kvflow import LLM, SamplingParams

# Outputs several windows long (Gemma's tiny window is 8), with repeats for the n-gram proposer.
PROMPTS = [[3, 4, 5, 6, 7] * 4, [9, 10, 11] * 3, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for name in ("gemma3", "deepseek-v2", "mixtral", "llama-gqa-llama3-rope"):
        dirs[name] = str(tmp_path_factory.mktemp(name))
        make_tiny_model(name, dirs[name])
    return dirs


@pytest.fixture(scope="module")
def baselines(model_dirs):
    """Each target's output without speculation (its parity with the oracle is
    tests/model/test_architectures.py's), computed once."""
    cache = {}

    def baseline(target: str) -> list[list[int]]:
        if target not in cache:
            cache[target] = _tokens(_llm(model_dirs[target]))
        return cache[target]

    return baseline


def _llm(path: str, spec: dict | None = None, **kw) -> LLM:
    return LLM(path, dtype="float32", skip_tokenizer_init=True, disable_log_stats=True, block_size=4,
               speculative_config=spec, **kw)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


CASES = [
    ("gemma3", dict(method="ngram", prompt_lookup_min=1)),
    ("gemma3", dict(method="layer_skip", num_draft_layers=2)),
    ("gemma3", dict(method="draft_model", model="llama-gqa-llama3-rope")),  # one full group: the global layer's table
    ("deepseek-v2", dict(method="ngram", prompt_lookup_min=1)),
    ("deepseek-v2", dict(method="layer_skip", num_draft_layers=2)),  # the dense layer and an MoE layer, MLA both
    ("mixtral", dict(method="layer_skip", num_draft_layers=1)),
]


@pytest.mark.parametrize("target,spec", CASES, ids=[f"{t}-{s['method']}" for t, s in CASES])
def test_greedy_output_is_the_non_speculative_output(model_dirs, baselines, target, spec):
    want = baselines(target)
    if "model" in spec:
        spec = dict(spec, model=model_dirs[spec["model"]])
    # A pool of 40 blocks: the three requests' global layers alone need 3 × 11, so Gemma's sliding
    # groups must give blocks back (and preemption may follow) for them to run together.
    llm = _llm(model_dirs[target], dict(spec, num_speculative_tokens=3, adaptive=False), num_kv_blocks=40)
    assert _tokens(llm) == want
    engine = llm.llm_engine
    stats = engine.get_stats().spec_decoding
    assert stats.num_draft_tokens > 0
    assert engine.kv_cache_usage == 0.0


def test_a_rollback_never_reaches_a_block_the_window_gave_back(model_dirs):
    """Step by step on Gemma 3 with speculation: every sliding table entry still in the window of
    the next token to compute holds a block, so the next verification never reads a freed one."""
    llm = _llm(model_dirs["gemma3"], dict(method="ngram", prompt_lookup_min=1, num_speculative_tokens=3,
                                          adaptive=False))
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    kv, freed, rejected = engine.scheduler.kv_cache, False, False
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.get_stats().spec_decoding
        rejected |= stats.num_accepted_tokens < stats.num_draft_tokens
        request = engine.scheduler.requests.get("r")
        if request is None:
            break
        for window, table in zip(kv.sliding_windows, kv.block_ids("r")):
            live = kv._first_live(window, request.num_computed_tokens)
            assert -1 not in table[live:]
            freed |= -1 in table
    assert freed and rejected  # the window gave blocks back, and proposals were rolled back


def test_a_draft_model_with_several_kv_groups_is_refused(model_dirs):
    with pytest.raises(ValueError, match="the draft model has 6 KV groups"):
        _llm(model_dirs["llama-gqa-llama3-rope"], dict(method="draft_model", model=model_dirs["gemma3"],
                                                        num_speculative_tokens=2))
