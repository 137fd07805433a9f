"""Values that pass a type check but would break a step for everyone are refused up front with
a ValueError naming the field: top_k or seed beyond int64, stop ids outside the vocabulary,
logprobs beyond max_logprobs. A request running beside the refused one is untouched. And
`LLM.generate` takes vLLM's `priority` list."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

VOCAB = 97


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama-mha-tied", path)
    return str(path)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GOOD = SamplingParams(temperature=0, max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.mark.parametrize("fields,message", [
    (dict(top_k=2**63), "top_k must be an integer in"),
    (dict(top_k=2**70), "top_k must be an integer in"),
    (dict(seed=2**63), "seed must be an integer in"),
    (dict(seed=-2**63 - 1), "seed must be an integer in"),
])
def test_sampling_params_refuse_values_beyond_int64(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


@pytest.mark.parametrize("fields,message", [
    (dict(min_tokens=2, stop_token_ids=[1_000_000]), r"stop_token_ids must be token ids in \[0, 97\); got 1000000"),
    (dict(min_tokens=2, stop_token_ids=[3, 2**63]), r"stop_token_ids .* got 9223372036854775808"),
    (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(logprobs=6), r"logprobs must be at most 5 \(max_logprobs\); got 6"),
    (dict(prompt_logprobs=7), r"prompt_logprobs must be at most 5"),
])
def test_engine_refuses_what_would_fail_a_step_and_the_running_request_goes_on(model_dir, fields, message):
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_logprobs=5,
                                  disable_log_stats=True))
    engine.add_request("alone", _prompt(9), GOOD)
    expected = engine.step() + [o for _ in range(10) for o in engine.step()]
    engine.add_request("good", _prompt(9), GOOD)
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", _prompt(5), SamplingParams(max_tokens=4, **fields))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [o.request_id for o in outs] == ["good"]
    assert outs[0].outputs[0].token_ids == [o for o in expected if o.finished][0].outputs[0].token_ids
    assert engine.kv_cache_usage == 0.0


def test_large_top_k_and_extreme_seeds_run(model_dir):
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, disable_log_stats=True)
    params = [SamplingParams(top_k=2**62, max_tokens=3), SamplingParams(seed=2**63 - 1, n=3, max_tokens=3),
              SamplingParams(seed=-2**63, max_tokens=3)]
    outs = llm.generate([_prompt(4)] * 3, params, use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [3, 3, 3, 3, 3]


def test_max_logprobs_minus_one_means_up_to_the_vocabulary(model_dir):
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, max_logprobs=-1, disable_log_stats=True)
    out = llm.generate([_prompt(4)], SamplingParams(max_tokens=1, logprobs=VOCAB), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == VOCAB
    with pytest.raises(ValueError, match="logprobs must be at most 97"):
        llm.generate([_prompt(4)], SamplingParams(max_tokens=1, logprobs=VOCAB + 1), use_tqdm=False)


def test_llm_generate_takes_a_priority_per_prompt(model_dir):
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, scheduling_policy="priority", max_num_seqs=1,
              disable_log_stats=True)
    outs = llm.generate([_prompt(5, s) for s in range(3)], SamplingParams(max_tokens=2), use_tqdm=False,
                        priority=[2, 0, 1])
    first_token = [o.metrics.first_token_time for o in outs]
    assert first_token[1] < first_token[2] < first_token[0]  # one at a time, lowest priority value first
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        llm.generate([_prompt(5, s) for s in range(3)], SamplingParams(max_tokens=2), priority=[0, 1])


def test_prompt_logprobs_of_a_long_prompt_are_scored_in_bounded_slices(model_dir, monkeypatch):
    from kvflow.worker import model_runner

    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, disable_log_stats=True)
    prompt = _prompt(300)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    whole = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    model = llm.llm_engine.runner.model
    rows_seen, compute_logits = [], model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h, **kw: rows_seen.append(len(h)) or compute_logits(h, **kw))
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 64)
    llm.reset_prefix_cache()
    sliced = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert max(rows_seen) <= 64 and sum(rows_seen) == 299 + 1  # every prompt row once, then the sampled row
    assert [sorted(p) if p else p for p in sliced] == [sorted(p) if p else p for p in whole]
    for a, b in zip(sliced[1:], whole[1:]):
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank for t in a)
