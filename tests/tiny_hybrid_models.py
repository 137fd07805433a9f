"""Tiny random HF Bamba checkpoints (Mamba-2 mixers and attention in one model), written at test
time (tests/model/test_bamba.py)."""

from __future__ import annotations

from pathlib import Path

import torch

# Four layers, attention in layers 1 and 3 (two KV groups' worth of blocks, one state group of two
# mixers); the mixers: 8 heads of 16 channels (hidden 64 x expand 2), 16 states, chunks of 8 tokens,
# so prompts of 21 tokens end in a partial chunk; attention: 4 heads of 16 over 2 KV heads, RoPE on
# the first 8 channels of each head.
_BAMBA = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
              mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=512,
              rms_norm_eps=1e-5, initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# name → extra BambaConfig fields
BAMBA_CONFIGS: dict[str, dict] = {
    "bamba-g1": dict(tie_word_embeddings=False),
    # Two groups of four heads, biased mixer projections, a tied head.
    "bamba-g2-bias": dict(mamba_n_groups=2, mamba_proj_bias=True, tie_word_embeddings=True),
}


def make_tiny_bamba(name: str, directory: Path, seed: int = 0):
    """Write a random checkpoint to `directory` and return transformers' model (float32, eager
    attention: the reference path)."""
    import transformers

    config = transformers.BambaConfig(**{**_BAMBA, **BAMBA_CONFIGS[name]})
    torch.manual_seed(seed)
    model = transformers.BambaForCausalLM(config).float().eval()
    with torch.no_grad():  # HF starts norms at 1, D at 1 and biases at 0; random ones make each path matter
        for param_name, p in model.named_parameters():
            if param_name.endswith(("norm.weight", "layernorm.weight", "bias", ".D")):
                p.add_(torch.randn_like(p) * 0.1)
            if param_name.endswith("dt_bias"):  # steps of 0.01 to 2: some decay fast, some slowly
                p.copy_(torch.empty_like(p).uniform_(-4.5, 1.5))
    model.save_pretrained(directory, safe_serialization=True)
    return model


# Tiny random HF LFM2 checkpoints (gated short convolutions and attention in one model),
# tests/model/test_lfm2.py. Four layers, convolutions of kernel 3 (a state of 2 inputs per channel)
# interleaved with attention: 4 heads of 16 over 2 KV heads, q/k norms per head, RoPE.
_LFM2 = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, conv_L_cache=3, max_position_embeddings=512, norm_eps=1e-5,
             initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# name → extra Lfm2Config fields
LFM2_CONFIGS: dict[str, dict] = {
    # The MLP's width derived as published checkpoints do: 2/3 of 96 is 64, x 1.4 is 89, rounded up to 32: 96.
    "lfm2-conv-first": dict(layer_types=["conv", "full_attention", "conv", "full_attention"],
                            block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.4, block_multiple_of=32,
                            tie_word_embeddings=True),
    # Attention first, two convolutions in a row, biased convolutions and projections, an untied head.
    "lfm2-attn-first-bias": dict(layer_types=["full_attention", "conv", "conv", "full_attention"],
                                 block_auto_adjust_ff_dim=False, conv_bias=True, tie_word_embeddings=False),
    # No attention: the states are the block pool's blocks, as Mamba-2's are.
    "lfm2-conv-only": dict(layer_types=["conv"] * 4),
    # Neither layer_types nor full_attn_idxs: every layer attends (Lfm2Config's default).
    "lfm2-attn-only": dict(),
}
# The two hybrids: states in slots beside attention blocks.
LFM2_HYBRIDS = ("lfm2-conv-first", "lfm2-attn-first-bias")


def make_tiny_lfm2(name: str, directory: Path, seed: int = 0):
    """Write a random LFM2 checkpoint to `directory` and return transformers' model (float32, eager
    attention: the reference path)."""
    import transformers

    # use_cache=False: transformers' cache cannot count positions in a model without attention, and
    # the tests' oracle runs whole sequences anyway.
    config = transformers.Lfm2Config(**{**_LFM2, **LFM2_CONFIGS[name]}, attn_implementation="eager", use_cache=False)
    torch.manual_seed(seed)
    model = transformers.Lfm2ForCausalLM(config).float().eval()
    with torch.no_grad():  # HF starts norms at 1 and biases at 0; random ones make each path matter
        for param_name, p in model.named_parameters():
            if param_name.endswith(("norm.weight", "layernorm.weight", "bias")):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return model


# -- the serving checks every hybrid is held to (tests/model/test_bamba.py, test_lfm2.py) ------------

GREEDY = dict(temperature=0, logprobs=0, ignore_eos=True)


def token_prompts(lengths, seed=1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]


def assert_nothing_held(llm_engine) -> None:
    """Every block back in the pool and every state slot released."""
    kv = llm_engine.scheduler.kv_cache
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert [slots.num_held for slots in kv.state_slots if slots is not None] == [0]


def check_chunked_and_batched_match_transformers(directory: str, hf, step_tokens: int) -> None:
    """Three prompts (two longer than the step's budget at 16: their prompts split over steps, the
    states carried while the attention layers read their KV) decoded together: every prompt
    position's and generated token's logprob within 1e-4 of transformers, each greedy token its
    argmax; each prompt alone gives the same tokens; no prefix cache; nothing held after."""
    from hf_oracle import assert_matches_oracle

    from kvflow import LLM, SamplingParams

    llm = LLM(directory, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=step_tokens,
              num_kv_blocks=16, enable_prefix_caching=True)
    prompts = token_prompts((21, 5, 40))
    batched = llm.generate(prompts, SamplingParams(max_tokens=12, prompt_logprobs=0, **GREEDY))
    for prompt, out in zip(prompts, batched):
        assert_matches_oracle(hf, prompt, out, 12)
    for prompt, out in zip(prompts, batched):  # alone: slot 0 again, holding the last request's states
        assert llm.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0].token_ids == \
            out.outputs[0].token_ids
    assert not llm.llm_engine.scheduler.kv_cache.pool.enable_caching  # a model with state: no prefix cache
    assert_nothing_held(llm.llm_engine)


def check_n_completions_hold_their_own_states(directory: str, hf) -> None:
    """n = 3 sampled completions of one prompt run side by side, each from its own slot: they
    diverge, and every token's logprob is transformers' for that completion within 1e-4."""
    from kvflow import LLM, SamplingParams

    llm = LLM(directory, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    prompt = token_prompts((19,), seed=3)[0]
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, logprobs=0, ignore_eos=True)
    completions = llm.generate([prompt], params)[0].outputs
    assert len({tuple(c.token_ids) for c in completions}) > 1
    for completion in completions:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        ours = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)])
        assert (ours - ref[torch.arange(10), torch.tensor(completion.token_ids)]).abs().max() < 1e-4
    assert_nothing_held(llm.llm_engine)


def check_a_preempted_request_recomputes_its_states(directory: str, hf) -> None:
    """Four attention blocks for two requests that grow to six: the later, more urgent one preempts
    the first, which starts over from zeros in a slot the other's states may have been in."""
    from hf_oracle import assert_matches_oracle

    from kvflow import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine(EngineArgs(directory, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=4,
                                  max_num_batched_tokens=16, scheduling_policy="priority", disable_log_stats=True))
    first, second = token_prompts((30, 9), seed=4)
    engine.add_request("first", first, SamplingParams(max_tokens=20, **GREEDY), priority=1)
    finished = {}
    for _ in range(4):
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.add_request("second", second, SamplingParams(max_tokens=10, **GREEDY), priority=0)
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.scheduler.num_preemptions_total >= 1
    assert_matches_oracle(hf, first, finished["first"], 20)
    assert_matches_oracle(hf, second, finished["second"], 10)
    assert_nothing_held(engine)


def check_swap_is_refused(directory: str) -> None:
    import pytest

    from kvflow import EngineArgs, LLMEngine

    with pytest.raises(ValueError, match="preemption_mode='swap'.*recompute"):
        LLMEngine(EngineArgs(directory, dtype="float32", skip_tokenizer_init=True, preemption_mode="swap",
                             swap_space_gb=0.01, disable_log_stats=True))
