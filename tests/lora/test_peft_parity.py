"""Adapted outputs against PEFT on tiny random bases: a batch mixing three adapters and the base
matches PEFT's logprobs within 1e-4 (float32) at every prompt and output position, and each of
its requests equals the same request run alone."""

from __future__ import annotations

import pytest
import torch
from peft_adapters import check_logprobs, make_adapter
from tiny_models import make_tiny_model

from kvflow import LLM, LoRARequest, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=0, prompt_logprobs=0, ignore_eos=True)
# Three adapters that differ in every way PEFT lets them: rank, scaling, targets, per-module patterns.
ADAPTERS = {
    "all-r4": dict(r=4, lora_alpha=8),
    "qv-r8-rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp-patterns": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"],
                         rank_pattern={"down_proj": 6}, alpha_pattern={"o_proj": 3}),
}


def _prompts(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module", params=["llama-gqa-llama3-rope", "qwen2-bias", "qwen3-qknorm"])
def setup(request, tmp_path_factory):
    base_dir = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, base_dir)
    oracles, loras = {None: hf}, {}
    for i, (name, config) in enumerate(ADAPTERS.items(), start=1):
        directory = tmp_path_factory.mktemp(name)
        oracles[name] = make_adapter(hf, directory, seed=i, **config)
        loras[name] = LoRARequest(name, i, str(directory))
    llm = LLM(str(base_dir), dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_loras=3,
              max_lora_rank=8, disable_log_stats=True)
    return llm, oracles, loras, hf.config.vocab_size


def test_mixed_batch_matches_peft_and_each_request_alone(setup):
    llm, oracles, loras, vocab = setup
    names = [None, *ADAPTERS] * 2  # every adapter twice, interleaved with base requests
    prompts = _prompts(vocab, [3, 17, 40, 9, 23, 5, 31, 12])
    batch = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=[loras.get(n) for n in names])
    for name, out in zip(names, batch):
        check_logprobs(out, oracles[name])
    for name, prompt, together in zip(names, prompts, batch):
        [alone] = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=loras.get(name))
        assert alone.outputs[0].token_ids == together.outputs[0].token_ids
        torch.testing.assert_close([lp[t].logprob for lp, t in zip(alone.outputs[0].logprobs, alone.outputs[0].token_ids)],
                                   [lp[t].logprob for lp, t in zip(together.outputs[0].logprobs, together.outputs[0].token_ids)],
                                   atol=1e-4, rtol=0)


def test_adapters_change_the_output(setup):
    """The oracle check above would pass for adapters that do nothing: they must not."""
    llm, oracles, loras, vocab = setup
    prompt = _prompts(vocab, [20], seed=3)[0]
    outs = [llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=loras.get(n))[0] for n in [None, *ADAPTERS]]
    firsts = [out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].logprob for out in outs]
    assert len({round(f, 3) for f in firsts}) == len(firsts)
