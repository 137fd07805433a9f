"""Tiny random HF Mamba-2 checkpoints, written at test time (tests/model/test_mamba2.py)."""

from __future__ import annotations

from pathlib import Path

import torch

# 8 heads of 16 channels (hidden 64 x expand 2), 16 states, chunks of 8 tokens: prompts of 21
# tokens end in a partial chunk.
_MAMBA2 = dict(vocab_size=97, hidden_size=64, num_heads=8, head_dim=16, expand=2, state_size=16, conv_kernel=4,
               chunk_size=8, num_hidden_layers=2, layer_norm_epsilon=1e-5, initializer_range=0.3)

# name → extra Mamba2Config fields
MAMBA2_CONFIGS: dict[str, dict] = {
    # One group: every head reads the same B and C; the norm normalises all channels together.
    "mamba2-g1": dict(n_groups=1, tie_word_embeddings=True),
    # Two groups of four heads, biased projections, an untied head.
    "mamba2-g2-bias": dict(n_groups=2, use_bias=True, tie_word_embeddings=False),
    # A step-size ceiling the random steps exceed, so the clamp decides every state.
    "mamba2-g2-dt-limit": dict(n_groups=2, time_step_limit=(0.0, 0.05), tie_word_embeddings=False),
}


def make_tiny_mamba2(name: str, directory: Path, seed: int = 0):
    """Write a random checkpoint to `directory` and return transformers' model (float32)."""
    import transformers

    config = transformers.Mamba2Config(**{**_MAMBA2, **MAMBA2_CONFIGS[name]})
    torch.manual_seed(seed)
    model = transformers.Mamba2ForCausalLM(config).float().eval()
    with torch.no_grad():  # HF starts norms at 1, D at 1 and biases at 0; random ones make each path matter
        for param_name, p in model.named_parameters():
            if param_name.endswith(("norm.weight", "norm_f.weight", "bias", ".D")):
                p.add_(torch.randn_like(p) * 0.1)
            if param_name.endswith("dt_bias"):  # steps of 0.01 to 2: some decay fast, some slowly
                p.copy_(torch.empty_like(p).uniform_(-4.5, 1.5))
    model.save_pretrained(directory, safe_serialization=True)
    return model
