"""Every KV-shrinking architecture and mixture of experts against transformers, float32.

One batch per (architecture, backend) takes every path that touches the per-group KV cache:
prompts longer than the sliding window, prefill chunked to a 16-token budget, a pool too small
for all three requests (preemption, by recompute or by swap), and a request that reuses another's
cached prefix. Prompt logprobs and 32 greedy steps must match the oracle within 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_oracle import assert_matches_oracle
from tiny_models import ARCH_CONFIGS, make_tiny_model

from kvflow import LLM, SamplingParams
from kvflow.analysis.model_spec import ModelSpec
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.model.arch_config import ArchConfig

BLOCK, BUDGET, STEPS = 4, 16, 32
# The CPU fast path for all; the oracle backend where attention itself is new (per-group windows,
# MLA); swap for a hybrid and an MLA model.
CASES = [(arch, "torch_sdpa", "recompute") for arch in sorted(ARCH_CONFIGS)]
CASES += [("gemma3", "torch_reference", "recompute"), ("deepseek-v2", "torch_reference", "recompute")]
CASES += [("gemma3", "torch_sdpa", "swap"), ("deepseek-v3", "torch_sdpa", "swap")]


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(0, vocab, (40,), generator=gen).tolist()
    second = torch.randint(0, vocab, (27,), generator=gen).tolist()
    return [first, second, first[:24] + torch.randint(0, vocab, (12,), generator=gen).tolist()]


@pytest.mark.parametrize(("arch", "backend", "preemption"), CASES)
def test_matches_transformers_through_chunks_preemption_and_prefix_hits(arch, backend, preemption, tmp_path):
    hf = make_tiny_model(arch, tmp_path)
    cfg = ArchConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    # Room for the longest request alone, not for all three at once.
    need = KVCacheManager(1, BLOCK, sliding_windows=cfg.kv_layout.sliding_windows).max_blocks_held(40 + STEPS, BUDGET)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, attention_backend=backend, block_size=BLOCK,
              max_num_batched_tokens=BUDGET, num_kv_blocks=need + 2, preemption_mode=preemption, swap_space_gb=0.01)
    prompts = _prompts(hf.config.vocab_size)
    with_prompt = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    reuses_prefix = with_prompt.clone(prompt_logprobs=None)  # requests owing prompt logprobs compute every position
    outputs = llm.generate(prompts, [with_prompt, with_prompt, reuses_prefix])
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions_total > 0
    if preemption == "recompute":
        assert engine.scheduler.kv_cache.prefix_cache_hits > 0
    assert engine.kv_cache_usage == 0.0  # every block came back
    for prompt, out in zip(prompts, outputs):
        assert_matches_oracle(hf, prompt, out, STEPS)


def test_mla_caches_the_latent_and_never_expands_kv_for_the_context(tmp_path):
    make_tiny_model("deepseek-v2", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK, num_kv_blocks=64)
    engine = llm.llm_engine
    latent = 16 + 8  # kv_lora_rank + qk_rope_head_dim
    assert {tuple(c.shape) for c in engine.runner.kv_caches} == {(1, 64, BLOCK, latent)}
    spec = ModelSpec.from_arch(engine.arch)
    assert spec.kv_bytes_per_token("float32") == 3 * latent * 4  # the formula: layers x (rank + rope) x bytes
    assert spec.kv_bytes_per_token("float32") == engine.arch.kv_layout.block_bytes(1, 4) * len(engine.arch.kv_layout.groups)
    calls = []
    for layer in engine.runner.model.model.layers:
        proj = layer.self_attn.kv_b_proj
        proj.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    llm.generate([list(range(30))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert calls == [16] * 3  # once per layer, on the identity (absorption); never on cached latents
