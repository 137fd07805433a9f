"""The runner tells the sampler on the host which work a batch needs (so the sampler never reads a
device value to decide); a wrong flag would silently drop a user's sampling setting."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from tiny_models import make_tiny_model

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


def test_greedy_batches_skip_the_float32_logits_and_keep_their_tokens(tmp_path, monkeypatch):
    """A bfloat16 model's greedy batch with nothing to adjust takes the argmax of the head's own
    bfloat16 logits (no float32 copy); any batch that samples or scores gets float32 ones. The
    tokens are those of the float32 logits."""
    make_tiny_model("llama-gqa-llama3-rope", tmp_path)
    llm = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, device="cpu", disable_log_stats=True)
    model = llm.llm_engine.runner.model
    compute_logits, dtypes = model.compute_logits, []

    def recording(hidden, widen=True):
        logits = compute_logits(hidden, widen)
        dtypes.append(logits.dtype)
        return logits

    monkeypatch.setattr(model, "compute_logits", recording)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    raw = _tokens(llm, greedy)
    assert set(dtypes) == {torch.bfloat16}
    dtypes.clear()
    monkeypatch.setattr(model, "compute_logits", lambda hidden, widen=True: recording(hidden, True))
    assert _tokens(llm, greedy) == raw  # the float32 logits' argmax
    dtypes.clear()
    monkeypatch.setattr(model, "compute_logits", recording)
    _tokens(llm, SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True))
    _tokens(llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))
    assert set(dtypes) == {torch.float32}
