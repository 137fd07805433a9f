"""OpenAI's logit_bias, applied in the sampler to its own row only (float32, a tiny model): +100
all but forces a token, -100 bans one, a bias leaves its batch's other rows bit for bit as they
are alone, and the logprobs reported stay the model's."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama-gqa-llama3-rope", path)
    # No prefix caching: a rerun computes the same batches, so rows compare bit for bit.
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, block_size=8,
              enable_prefix_caching=False, disable_log_stats=True)
    yield llm
    llm.llm_engine.shutdown()


def _prompt(n: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(0, 97, (n,), generator=gen).tolist()}


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


def _run(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_bias_moves_only_its_own_row(llm):
    prompts = [_prompt(9, 1), _prompt(14, 2), _prompt(5, 3)]
    alone = _run(llm, prompts, GREEDY)
    banned = alone[1].token_ids[0]
    params = [GREEDY, GREEDY.clone(logit_bias={banned: -100.0}), GREEDY.clone(logit_bias={42: 100.0})]
    biased = _run(llm, prompts, params)
    assert biased[0].token_ids == alone[0].token_ids  # its neighbours' biases do not reach it
    assert [lp[t].logprob for lp, t in zip(biased[0].logprobs, biased[0].token_ids)] == \
        [lp[t].logprob for lp, t in zip(alone[0].logprobs, alone[0].token_ids)]
    assert biased[1].token_ids[0] != banned
    assert biased[2].token_ids == [42] * 8  # +100 all but forces it
    # The reported logprob of the forced token is the model's own, not the biased one.
    assert biased[2].logprobs[0][42].logprob < -0.5


def test_seeded_sampling_with_a_bias_is_reproducible_and_biased(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=32, ignore_eos=True, logit_bias={7: 8.0})
    one, two = _run(llm, [_prompt(6, 4)], params), _run(llm, [_prompt(6, 4)], params)
    unbiased = _run(llm, [_prompt(6, 4)], params.clone(logit_bias=None))
    assert one[0].token_ids == two[0].token_ids
    assert one[0].token_ids.count(7) > unbiased[0].token_ids.count(7)


@pytest.mark.parametrize("bias, message", [
    ({"7": 1.0}, "logit_bias"), ({7: 101.0}, "logit_bias"), ({-1: 1.0}, "logit_bias"),
])
def test_a_bad_bias_is_refused_by_name(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_a_bias_past_the_vocabulary_is_refused_by_the_engine(llm):
    with pytest.raises(ValueError, match=r"logit_bias must be token ids in \[0, 97\); got 97"):
        llm.generate([_prompt(3, 1)], GREEDY.clone(logit_bias={97: 1.0}), use_tqdm=False)
