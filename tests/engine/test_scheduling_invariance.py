"""Greedy output must not depend on how the scheduler cut the work: alone or batched, chunked
prefill, preemption and recomputation, any block size."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-gqa")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (1, 9, 16, 31, 50, 70)]


def _greedy(model_dir, prompts, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, **engine_args)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)], llm


@pytest.fixture(scope="module")
def baseline(model_dir, prompts):
    tokens, _ = _greedy(model_dir, prompts, attention_backend="torch_reference")
    return tokens


def test_batched_equals_alone(model_dir, prompts, baseline):
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True)
    alone = [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in prompts]
    assert alone == baseline


def test_chunked_prefill(model_dir, prompts, baseline):
    # A budget far below the longest prompt: prompts are cut into chunks that share steps with decodes.
    tokens, _ = _greedy(model_dir, prompts, max_num_batched_tokens=7)
    assert tokens == baseline


def test_preemption_and_recompute(model_dir, prompts, baseline):
    # 9 blocks of 16 tokens: the longest request alone needs 6, so they cannot all run together.
    tokens, llm = _greedy(model_dir, prompts, num_kv_blocks=9, block_size=16)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert tokens == baseline
    assert llm.llm_engine.kv_cache_usage == 0.0  # every block returned


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_block_sizes(model_dir, prompts, baseline, block_size):
    tokens, _ = _greedy(model_dir, prompts, block_size=block_size)
    assert tokens == baseline


def test_max_num_seqs_one(model_dir, prompts, baseline):
    tokens, _ = _greedy(model_dir, prompts, max_num_seqs=1)
    assert tokens == baseline
