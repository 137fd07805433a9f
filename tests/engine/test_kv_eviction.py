"""Token eviction in the paged pool (kvflow.core.kv_eviction), against transformers in float32 with
the same eviction applied as an attention mask: the plain-torch definition of what each query sees."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_oracle import assert_matches_oracle
from tiny_models import COMMON, make_tiny_model, run_to_end

from kvflow import LLM, SamplingParams
from kvflow.config import EngineArgs
from kvflow.core.kv_eviction import KVEviction
from kvflow.engine.llm_engine import LLMEngine
from kvflow.worker.cpu_decode import CpuDecodeLoop

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(directory, transformers model) of a 2-layer GQA Llama with a 1,024-position context."""
    directory = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 1024}, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    hf.save_pretrained(directory)
    return str(directory), hf


def evicting_oracle(hf, eviction: KVEviction, sliding_window: int | None = None):
    """transformers' model, each query attending to the positions `eviction.visible` gives it; with
    `sliding_window`, Gemma 3's sliding layers attending to their window instead."""
    def forward(input_ids: torch.Tensor):
        length = input_ids.shape[1]
        seen = torch.zeros(length, length, dtype=torch.bool)
        for p in range(length):
            for run in eviction.visible(p):
                seen[p, run.start:run.stop] = True
        mask = torch.zeros(1, 1, length, length).masked_fill_(~seen, float("-inf"))
        if sliding_window is not None:
            pos = torch.arange(length)
            window = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < sliding_window)
            local = torch.zeros(1, 1, length, length).masked_fill_(~window, float("-inf"))
            mask = {"full_attention": mask, "sliding_attention": local}
        return hf(input_ids, attention_mask=mask)
    return forward


def _prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]


def test_the_rule_keeps_sinks_and_the_recent_run_within_the_budget():
    eviction = KVEviction.resolve("sink_window", 100, BLOCK)  # rounded down to whole blocks
    assert (eviction.budget_tokens, eviction.sink_tokens, eviction.interval) == (96, 16, 16)
    for p in range(400):
        sinks, recent = eviction.visible(p)
        assert len(sinks) + len(recent) <= eviction.budget_tokens
        assert recent.stop == p + 1 and (p < 96 or len(sinks) == 16)
    sinks, recent = eviction.visible(200)  # point 192: 192 - (96 - 16) = 112 tokens gone after the sinks
    assert (sinks, recent) == (range(16), range(128, 201))


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16])
def test_every_budget_keeps_the_sinks_apart_from_the_recent_run(block_size):
    """Down to the smallest budget of every block size (4 sink tokens outgrow a block of 1 or 2)."""
    smallest = KVEviction.resolve("sink_window", 10_000, block_size).sink_tokens + 2 * block_size
    with pytest.raises(ValueError, match=f">= {smallest}"):
        KVEviction.resolve("sink_window", smallest - 1, block_size)
    for budget in range(smallest, smallest + 40):
        eviction = KVEviction.resolve("sink_window", budget, block_size)
        for p in range(200):
            sinks, recent = eviction.visible(p)
            assert len(sinks) + len(recent) <= eviction.budget_tokens and recent.stop == p + 1
            assert recent.start >= min(eviction.sink_tokens, p + 1)


@pytest.mark.parametrize(("policy", "budget", "message"), [
    ("h2o", 64, "not implemented yet"),
    ("lru", 64, "kv_eviction_policy must be one of none, sink_window"),
    ("sink_window", None, "kv_budget_tokens must be an integer >= 48"),
    ("sink_window", 40, "kv_budget_tokens must be an integer >= 48"),
])
def test_a_policy_that_cannot_run_is_refused_by_name(policy, budget, message):
    with pytest.raises(ValueError, match=message):
        KVEviction.resolve(policy, budget, BLOCK)


@pytest.mark.parametrize("budget_per_step", [48, 200])
def test_sink_window_matches_the_masked_oracle_whatever_the_chunks(tiny_llama, budget_per_step):
    """Prompts longer than the budget, chunked two ways by the step's token budget: the same tokens
    and logprobs as transformers with the eviction's mask, every prompt position included. The
    production path: the CPU kernels and the C++ decode step."""
    directory, hf = tiny_llama
    llm = LLM(directory, dtype="float32", skip_tokenizer_init=True, block_size=BLOCK,
              max_num_batched_tokens=budget_per_step, num_kv_blocks=64, kv_eviction_policy="sink_window",
              kv_budget_tokens=96)
    assert isinstance(llm.llm_engine.model_executor.driver_worker.model_runner.decode_graphs, CpuDecodeLoop)
    oracle = evicting_oracle(hf, KVEviction.resolve("sink_window", 96, BLOCK))
    prompts = _prompts((150, 20, 301))
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert_matches_oracle(oracle, prompt, out, 40)
    pool = llm.llm_engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing leaked
    assert not any(pool.ref_counts)


def test_a_prompt_larger_than_the_pool_runs_within_its_budget(tiny_llama):
    directory, hf = tiny_llama
    # 8 blocks hold 128 positions; the request reaches 600.
    engine = LLMEngine(EngineArgs(directory, dtype="float32", skip_tokenizer_init=True, block_size=BLOCK,
                                  num_kv_blocks=8, max_num_batched_tokens=64, disable_log_stats=True,
                                  kv_eviction_policy="sink_window", kv_budget_tokens=128))
    prompt = _prompts((560,))[0]
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=40, logprobs=0, ignore_eos=True))
    pool, held, outputs = engine.scheduler.kv_cache.pool, [], []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        held.append(pool.num_blocks - pool.num_free_blocks)
    assert max(held) <= 8
    assert_matches_oracle(evicting_oracle(hf, KVEviction.resolve("sink_window", 128, BLOCK)), prompt, outputs[-1], 40)


def test_preempted_requests_evict_again_at_the_same_points(tiny_llama):
    """A pool too small for both requests' budgets: one is preempted and recomputed, and both still
    match the oracle (evictions happen at positions, not at steps)."""
    directory, hf = tiny_llama
    engine = LLMEngine(EngineArgs(directory, dtype="float32", skip_tokenizer_init=True, block_size=BLOCK,
                                  num_kv_blocks=9, max_num_batched_tokens=32, disable_log_stats=True,
                                  kv_eviction_policy="sink_window", kv_budget_tokens=96))
    prompts = _prompts((100, 90), seed=5)
    params = SamplingParams(temperature=0, max_tokens=60, logprobs=0, ignore_eos=True)
    outputs = run_to_end(engine, prompts, params)
    assert engine.scheduler.num_preemptions_total > 0
    oracle = evicting_oracle(hf, KVEviction.resolve("sink_window", 96, BLOCK))
    for prompt, out in zip(prompts, outputs):
        assert_matches_oracle(oracle, prompt, out, 60)


def test_a_request_asks_for_its_own_budget_and_the_others_keep_all(tiny_llama):
    directory, hf = tiny_llama
    llm = LLM(directory, dtype="float32", skip_tokenizer_init=True, block_size=BLOCK, num_kv_blocks=64,
              max_num_batched_tokens=64)
    prompt = _prompts((200,), seed=7)[0]
    common = dict(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True)
    evicted, full = llm.generate([prompt, prompt], [
        SamplingParams(**common, kv_eviction_policy="sink_window", kv_budget_tokens=64), SamplingParams(**common)])
    assert_matches_oracle(evicting_oracle(hf, KVEviction.resolve("sink_window", 64, BLOCK)), prompt, evicted, 24)
    assert_matches_oracle(hf, prompt, full, 24)
    with pytest.raises(ValueError, match="kv_budget_tokens applies with a kv_eviction_policy"):
        llm.generate([prompt], SamplingParams(**common, kv_budget_tokens=64))


def test_what_eviction_does_not_compose_with_is_refused_with_the_reason(tiny_llama):
    directory, _ = tiny_llama
    with pytest.raises(ValueError, match="does not compose with speculative_config yet"):
        LLM(directory, skip_tokenizer_init=True, kv_eviction_policy="sink_window", kv_budget_tokens=64,
            speculative_config={"method": "layer_skip", "num_speculative_tokens": 2, "num_draft_layers": 1})
    with pytest.raises(ValueError, match="kv_budget_tokens must be unset without a kv_eviction_policy"):
        LLM(directory, skip_tokenizer_init=True, kv_budget_tokens=64)


def test_on_gemma3_the_budget_bounds_the_global_layers_and_windows_stay(tmp_path):
    """Gemma 3 (5 sliding layers : 1 global): the global layers' table is compacted, the sliding
    layers keep their window of 8 by position. The oracle: transformers with the eviction's mask
    on the global layers and the window's on the others."""
    hf = make_tiny_model("gemma3", tmp_path)
    eviction = KVEviction.resolve("sink_window", 48, BLOCK)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK, num_kv_blocks=96,
              max_num_batched_tokens=40)
    oracle = evicting_oracle(hf, eviction, sliding_window=8)
    prompt = _prompts((100,), seed=11)[0]
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=0, prompt_logprobs=0, ignore_eos=True,
                            kv_eviction_policy="sink_window", kv_budget_tokens=48)
    assert_matches_oracle(oracle, prompt, llm.generate([prompt], params)[0], 30)


def test_ngram_speculation_under_a_budget_gives_the_tokens_without_it(tiny_llama):
    """Proposals are verified within an eviction interval (never across a point): greedy tokens are
    those of the same budget without speculation, and proposals were accepted along the way."""
    directory, _ = tiny_llama
    prompt = [5] * 150  # the tiny model repeats it for a while, so proposals are accepted and rejected
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, kv_eviction_policy="sink_window",
                            kv_budget_tokens=64)
    common = dict(dtype="float32", skip_tokenizer_init=True, block_size=BLOCK, num_kv_blocks=64, disable_log_stats=True)
    plain = LLM(directory, **common).generate([prompt], params)[0].outputs[0].token_ids
    llm = LLM(directory, **common, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == plain
    assert llm.llm_engine.get_stats().spec_decoding.num_accepted_tokens > 0
