"""The runner tells the sampler on the host which work a batch needs (so the sampler never reads a
device value to decide); a wrong flag would silently drop a user's sampling setting."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, SamplingParams

PROMPTS = [[5, 17, 3, 88, 40, 2, 9], [44, 45, 46]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, device="cpu", disable_log_stats=True)


def _tokens(llm, params_list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params_list, use_tqdm=False)]


def test_top_k_one_is_greedy_even_at_temperature_one(llm):
    greedy = _tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    top1 = _tokens(llm, SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=12, ignore_eos=True))
    assert top1 == greedy


def test_penalties_are_applied_to_a_greedy_batch(llm):
    def repeats(rows):
        return sum(len(t) - len(set(t)) for t in rows)

    plain = _tokens(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    penalised = _tokens(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                            frequency_penalty=2.0, presence_penalty=2.0))
    assert repeats(penalised) < repeats(plain)


def test_greedy_and_sampled_rows_in_one_batch(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_k=1, seed=1, max_tokens=12, ignore_eos=True)
    mixed = _tokens(llm, [greedy, sampled])
    assert mixed == _tokens(llm, greedy)  # top_k=1 draws the argmax: both rows greedy in effect


def test_the_sampler_gets_the_heads_dtype_and_widens_only_what_it_adjusts(tmp_path, monkeypatch):
    """A bfloat16 model's logits reach the sampler in bfloat16 (a plain greedy batch then makes no
    float32 copy); every batch's tokens and logprobs are those of float32 logits."""
    make_tiny_model("llama-gqa-llama3-rope", tmp_path)
    llm = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, device="cpu", disable_log_stats=True)
    model = llm.llm_engine.runner.model
    compute_logits, dtypes = model.compute_logits, []

    def recording(hidden, widen=True):
        logits = compute_logits(hidden, widen)
        dtypes.append(logits.dtype)
        return logits

    cases = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3)]

    def run(params):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    monkeypatch.setattr(model, "compute_logits", recording)
    raw = [run(params) for params in cases]
    assert set(dtypes) == {torch.bfloat16}
    monkeypatch.setattr(model, "compute_logits", lambda hidden, widen=True: compute_logits(hidden, True))
    assert [run(params) for params in cases] == raw  # float32 logits: the same tokens and logprobs
