"""Tiny random HF checkpoints of every supported architecture, written at test time."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.3)

# name → (transformers config class name, extra config fields)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama-mha-tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-gqa-llama3-rope": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=50000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "llama-mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False)),
    "mistral-window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=12,
                                             tie_word_embeddings=False)),
    "qwen2-bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-hybrid-window": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                                                use_sliding_window=True, sliding_window=10, max_window_layers=1,
                                                tie_word_embeddings=True)),
    # Wide enough (head_dim 64, 512-wide MLP) that bfloat16 kernels pick different paths by row count.
    "llama-wide": ("LlamaConfig", dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                       num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.05)),
    "qwen3-qknorm": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         tie_word_embeddings=False)),
}


_MOE = dict(num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, tie_word_embeddings=False)
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, num_hidden_layers=3, tie_word_embeddings=False)

# The KV-shrinking architectures and mixtures of experts (tests/model/test_architectures.py).
ARCH_CONFIGS: dict[str, tuple[str, dict]] = {
    # 5 local : 1 global, a window shorter than the prompts, soft-capped logits.
    "gemma3": ("Gemma3TextConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=6,
                                        sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                        rope_local_base_freq=100.0)),
    "mixtral": ("MixtralConfig", dict(_MOE, num_local_experts=4)),
    # One dense layer (mlp_only_layers), top-k renormalised.
    "qwen3-moe": ("Qwen3MoeConfig", dict(_MOE, num_experts=4, moe_intermediate_size=32, head_dim=16,
                                         norm_topk_prob=True, mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", dict(_MOE, num_experts=4, norm_topk_prob=False, eos_token_id=1, pad_token_id=0)),
    # No query bottleneck; routing limited to the best of two expert groups.
    "deepseek-v2": ("DeepseekV2Config", dict(_MLA, q_lora_rank=None, topk_method="group_limited_greedy", n_group=2,
                                             topk_group=1, routed_scaling_factor=1.5)),
    # A query bottleneck; plain greedy softmax routing over all experts.
    "deepseek-v2-q-lora": ("DeepseekV2Config", dict(_MLA, q_lora_rank=24, topk_method="greedy")),
    # A query bottleneck; sigmoid routing with a choice bias, renormalised and scaled.
    "deepseek-v3": ("DeepseekV3Config", dict(_MLA, q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=True,
                                             routed_scaling_factor=2.5)),
}

# The RoPE scalings of real checkpoints, their lengths scaled down to the tiny models'
# (tests/model/test_rope_scaling.py).
_LONG_FACTOR = [1.0, 1.2, 1.9, 3.1, 5.3, 8.4, 12.6, 17.9]  # Phi-3-style: grows toward low frequencies
ROPE_CONFIGS: dict[str, tuple[str, dict]] = {
    # Qwen2.5 / Qwen3 with YaRN enabled (factor 4 over their 32768): the default mscale on cos/sin;
    # max_position_embeddings stays the original, the served context is original x factor.
    "qwen3-yarn": ("Qwen3Config", dict(TINY_CONFIGS["qwen3-qknorm"][1], head_dim=16, max_position_embeddings=128,
                                       rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                         original_max_position_embeddings=128))),
    # YaRN as gpt-oss configures it (untruncated band) with a cos/sin factor mscale / mscale_all_dim != 1.
    "mistral-yarn-untruncated": ("MistralConfig", dict(
        TINY_CONFIGS["mistral-window"][1], sliding_window=None, rope_theta=150000.0,
        rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=32.0,
                          beta_slow=1.0, truncate=False, mscale=1.0, mscale_all_dim=0.5))),
    # DeepSeek-V3's {factor 40, original 4096, mscale = mscale_all_dim = 1} over 16 positions.
    "deepseek-v3-yarn": ("DeepseekV3Config", dict(ARCH_CONFIGS["deepseek-v3"][1], max_position_embeddings=640,
                                                  rope_scaling=dict(rope_type="yarn", factor=40.0,
                                                                    original_max_position_embeddings=16, beta_fast=32,
                                                                    beta_slow=1, mscale=1.0, mscale_all_dim=1.0))),
    # DeepSeek-V2's (old "type" key, mscale = mscale_all_dim = 0.707).
    "deepseek-v2-yarn": ("DeepseekV2Config", dict(ARCH_CONFIGS["deepseek-v2"][1], max_position_embeddings=640,
                                                  rope_scaling=dict(type="yarn", factor=40.0,
                                                                    original_max_position_embeddings=16, beta_fast=32,
                                                                    beta_slow=1, mscale=0.707, mscale_all_dim=0.707))),
    # Gemma 3 4B and larger: linear x8 on the global layers only (the local ones keep their base).
    "gemma3-linear": ("Gemma3TextConfig", dict(ARCH_CONFIGS["gemma3"][1], rope_parameters=dict(
        full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1_000_000.0),
        sliding_attention=dict(rope_type="default", rope_theta=100.0)))),
    # Phi-3-128k's layout: original length at the top level, no factor (max / original = 4).
    "llama-longrope": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.0, 1.02, 1.05, 1.1, 1.15, 1.2, 1.25],
                          long_factor=_LONG_FACTOR))),
    "llama-dynamic": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                          max_position_embeddings=64, rope_scaling=dict(rope_type="dynamic",
                                                                                        factor=2.0))),
}


def make_tiny_model(name: str, directory: Path, seed: int = 0):
    """Write a random checkpoint to `directory` and return the transformers model (float32, eager
    attention and eager experts)."""
    import transformers

    cls_name, extra = {**TINY_CONFIGS, **ARCH_CONFIGS, **ROPE_CONFIGS}[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          experts_implementation="eager").float().eval()
    with torch.no_grad():  # HF zero-inits biases; random ones make the bias path matter
        for name_, p in [*model.named_parameters(), *model.named_buffers()]:
            if name_.endswith("bias") or "norm" in name_:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return model


TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_tokenizer(directory: Path, chat_template: str = TINY_CHAT_TEMPLATE) -> None:
    """A character-level tokenizer that fits the tiny models' 97-token vocabulary: printable ASCII
    but '~', newline, and two special tokens (<|im_start|> = 95, <|im_end|> = 96, also EOS). Other
    characters are dropped. With it a tiny model serves text and chat like a real one."""
    import json

    import tokenizers
    from tokenizers import decoders, models

    chars = [chr(c) for c in range(32, 126)] + ["\n"]
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    backend.decoder = decoders.Fuse()
    backend.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": chat_template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_chat_model(directory: Path, name: str = "llama-gqa-llama3-rope") -> str:
    """A tiny random model with the character tokenizer and chat template in `directory`: what a
    server test serves. Returns the directory as a string (a `--model`)."""
    make_tiny_model(name, directory)
    write_tiny_tokenizer(directory)
    return str(directory)


def run_to_end(engine, prompts: list[list[int]], params) -> list:
    """Every prompt (request ids "0", "1", ...) through an LLMEngine's own steps until none is left:
    their final RequestOutputs, in prompt order (for tests that watch the engine between steps)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return [finished[str(i)] for i in range(len(prompts))]
