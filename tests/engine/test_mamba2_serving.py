"""Mamba-2 served by the engine: each request's recurrent state in its block of the pool's state
group, carried across prompt chunks, reset for a request starting over, swapped with the request,
against transformers' Mamba2ForCausalLM in float32 (the model itself: tests/model/test_mamba2.py)."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_matches_oracle
from tiny_ssm_models import make_tiny_mamba2

from kvflow import LLM, SamplingParams
from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module", params=["mamba2-g1", "mamba2-g2-bias"])
def tiny_mamba(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return str(directory), make_tiny_mamba2(request.param, directory)


def _prompts(lengths, seed=1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]


GREEDY = dict(temperature=0, logprobs=0, ignore_eos=True)


@pytest.mark.parametrize("step_tokens", [16, 512])
def test_prompts_chunked_and_batched_match_transformers(tiny_mamba, step_tokens):
    """Three prompts (one shorter than a chunk, two longer than the step's budget at 16) decoded
    together: every prompt position's and generated token's logprob within 1e-4 of transformers."""
    directory, hf = tiny_mamba
    llm = LLM(directory, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=step_tokens, num_kv_blocks=8)
    prompts = _prompts((21, 5, 40))
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=12, prompt_logprobs=0, **GREEDY))):
        assert_matches_oracle(hf, prompt, out, 12)
    # A one-token prompt alone: its first step is decode-shaped, and its state block (every block,
    # after eight requests at once) held a past state.
    llm.generate(_prompts((9,) * 8, seed=9), SamplingParams(max_tokens=2))
    out = llm.generate([[7]], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert_matches_oracle(hf, [7], out, 12)
    kv = llm.llm_engine.scheduler.kv_cache
    assert not kv.pool.enable_caching and kv.pool.num_free_blocks == kv.pool.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_request_resumes_its_state(tiny_mamba, mode):
    """One state block for two requests: the later, more urgent one preempts the first, which then
    starts over from zeros in a block another request's state was in (recompute), or gets its own
    state back from host memory (swap)."""
    directory, hf = tiny_mamba
    engine = LLMEngine(EngineArgs(directory, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=1,
                                  max_num_batched_tokens=16, scheduling_policy="priority", preemption_mode=mode,
                                  swap_space_gb=0.01, disable_log_stats=True))
    first, second = _prompts((30, 9), seed=4)
    engine.add_request("first", first, SamplingParams(max_tokens=20, **GREEDY), priority=1)
    finished = {}
    for _ in range(4):
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.add_request("second", second, SamplingParams(max_tokens=10, **GREEDY), priority=0)
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.scheduler.num_preemptions_total == 1
    assert_matches_oracle(hf, first, finished["first"], 20)
    assert_matches_oracle(hf, second, finished["second"], 10)


def test_the_default_dtype_follows_transformers_closely(tiny_mamba):
    """What users run on this CPU (bfloat16 weights, float32 states) against float32 transformers."""
    directory, hf = tiny_mamba
    llm = LLM(directory, skip_tokenizer_init=True, num_kv_blocks=8)
    prompt = _prompts((33,), seed=6)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    ours = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
    assert (ours - ref[torch.arange(8), torch.tensor(out.token_ids)]).abs().max() < 0.1


@pytest.mark.parametrize(("args", "message"), [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "does not compose with speculative"),
    (dict(kv_eviction_policy="sink_window", kv_budget_tokens=64), "does not compose with Mamba2ForCausalLM yet"),
    (dict(kv_cache_dtype="int8"), "does not apply to a model with recurrent state"),
])
def test_what_needs_per_position_kv_is_refused(tiny_mamba, args, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_mamba[0], skip_tokenizer_init=True, num_kv_blocks=8, **args)
