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
