"""The oracle check: kvflow's float32 reference path against HF transformers on the same weights.

For a batch of requests with different prompt lengths submitted together, the logprob of every
prompt token and of 32 greedy steps must match transformers' full-sequence forward within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from tiny_models import TINY_CONFIGS, make_tiny_model

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
        completion = out.outputs[0]
        assert len(completion.token_ids) == STEPS
        sequence = prompt + completion.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([sequence])).logits[0].float().log_softmax(-1)
        # Prompt logprobs: position p holds log P(prompt[p] | prompt[:p]); position 0 has none.
        assert out.prompt_logprobs[0] is None
        ours = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
        expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
        # Generated tokens: their logprobs, and each is the argmax of the oracle's distribution.
        rows = torch.arange(len(prompt) - 1, len(sequence) - 1)
        ours = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)])
        torch.testing.assert_close(ours, ref[rows, torch.tensor(completion.token_ids)], atol=1e-4, rtol=0)
        top2 = ref[rows].topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 1e-3  # skip exact near-ties, where float noise decides
        assert torch.equal(ref[rows].argmax(-1)[decided], torch.tensor(completion.token_ids)[decided])
