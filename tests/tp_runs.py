"""The run the tensor-parallel tests compare across rank counts: three prompts (1, 7 and 30
tokens, so chunked prefill and a one-token prompt are in it) in float32, greedy, with logprobs and
prompt logprobs."""

from __future__ import annotations

import torch

from kvflow import LLM, SamplingParams


def run_with_logprobs(path, tp: int) -> tuple[LLM, list]:
    """(the engine, its outputs); the caller shuts the engine down when done with it."""
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=tp, distributed_timeout_s=20,
              num_kv_blocks=64, block_size=8, max_num_batched_tokens=24)
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(0, 97, (n,), generator=gen).tolist()} for n in (1, 7, 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    return llm, llm.generate(prompts, params, use_tqdm=False)
