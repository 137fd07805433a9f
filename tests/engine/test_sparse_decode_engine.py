"""`--sparse-decode-blocks K` through the engine (the kernels and the choice themselves:
tests/attention/test_sparse_decode.py): with K at least a request's blocks it is the dense result
bit for bit; with fewer, a request's choice does not depend on where its blocks went (swapped out
and back into other blocks, whose key summaries the runner makes again)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model, run_to_end

from kvflow import LLM, SamplingParams
from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama-gqa-llama3-rope", directory)
    return str(directory)


def _prompts(lengths, seed=2) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]


PARAMS = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)


def _run(model_dir: str, prompts, **args) -> list:
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, block_size=16, disable_log_stats=True, **args)
    return [_tokens_and_logprobs(o) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def _tokens_and_logprobs(out) -> tuple[list[int], list[dict[int, float]]]:
    return out.outputs[0].token_ids, [{t: p.logprob for t, p in lp.items()} for lp in out.outputs[0].logprobs]


def test_with_as_many_blocks_as_a_request_has_it_is_dense_bit_for_bit(model_dir):
    prompts = _prompts((100, 30, 7))
    assert _run(model_dir, prompts, num_kv_blocks=64, sparse_decode_blocks=16) == _run(model_dir, prompts,
                                                                                       num_kv_blocks=64)


def test_a_swapped_request_chooses_as_if_it_had_stayed(model_dir):
    """Two 150-token requests reading 3 of their ~11 blocks: in a pool too small for both, one is
    swapped out and back into other blocks; its tokens and logprobs (to float noise: the two runs
    batch differently) are those of a roomy pool."""
    prompts = _prompts((150, 140), seed=3)
    roomy = _run(model_dir, prompts, num_kv_blocks=64, sparse_decode_blocks=3)
    engine = LLMEngine(EngineArgs(model_dir, dtype="float32", skip_tokenizer_init=True, block_size=16,
                                  disable_log_stats=True, num_kv_blocks=13, preemption_mode="swap", swap_space_gb=0.01,
                                  sparse_decode_blocks=3, max_num_batched_tokens=64))
    swapped = [_tokens_and_logprobs(o) for o in run_to_end(engine, prompts, PARAMS)]
    assert engine.scheduler.num_preemptions_total > 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(swapped, roomy):  # batched apart: float noise
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs):
            assert got.keys() == want.keys() and got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(("args", "message"), [
    (dict(sparse_decode_blocks=1), "sparse_decode_blocks must be an integer >= 2"),
    (dict(sparse_decode_blocks=4, attention_backend="torch_reference"), "needs attention_backend torch_sdpa or triton"),
])
def test_settings_it_cannot_run_with_are_refused(model_dir, args, message):
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, skip_tokenizer_init=True, **args)


def test_the_key_summaries_are_counted_in_the_pool(model_dir):
    """The same memory budget holds fewer blocks with the summaries beside them: a block of 16
    positions costs its K/V (2 x 2 KV heads x 16 x 16 float32 a layer: 4,096 bytes) and a min and a
    max a KV head (2 x 2 x 16 x 4: 256), a sixteenth more (an eighth with a bfloat16 pool)."""
    plain = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_gb=0.001)
    sparse = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_gb=0.001, sparse_decode_blocks=4)
    blocks, fewer = plain.llm_engine.num_kv_blocks, sparse.llm_engine.num_kv_blocks
    assert fewer == blocks * 16 // 17 < blocks
