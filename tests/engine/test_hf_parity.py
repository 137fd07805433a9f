"""The oracle check: kvflow's float32 reference path against HF transformers on the same weights.

For a batch of requests with different prompt lengths submitted together, the logprob of every
prompt token and of 32 greedy steps must match transformers' full-sequence forward within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_matches_oracle
from tiny_models import TINY_CONFIGS, make_tiny_model

from kvflow import LLM, SamplingParams

PROMPT_LENS = (3, 17, 40)  # within a block, across a block boundary, several blocks
STEPS = 32


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("backend", ["torch_reference", "torch_sdpa"])
@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_logprobs_match_transformers(arch, backend, tmp_path):
    hf = make_tiny_model(arch, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, attention_backend=backend)
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)

    for prompt, out in zip(prompts, outputs):
        assert_matches_oracle(hf, prompt, out, STEPS)
