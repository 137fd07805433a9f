"""Tiny random EAGLE-1 and EAGLE-3 heads, written at test time in the formats the published heads
use (safetensors), for a tiny Llama target with plain RoPE and four layers (EAGLE-3 reads three
of its layers' inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_models import COMMON

TARGET_CONFIG = dict(COMMON, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     tie_word_embeddings=False, rope_theta=10000.0)
AUX_LAYER_IDS = [0, 2, 3]  # vLLM's numbering: layer i's input (0: the embedding)
DRAFT_VOCAB = 61


def make_target(directory: Path, seed: int = 0, **config_changes):
    """The target checkpoint; returns the transformers model (float32, eager attention)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**TARGET_CONFIG, **config_changes}),
                                                          attn_implementation="eager").float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _layer_tensors(prefix: str, input_width: int, gen: torch.Generator, config: dict) -> dict[str, torch.Tensor]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    q_rows, kv_rows = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * cols ** -0.5

    return {f"{prefix}.self_attn.q_proj.weight": w(q_rows, input_width) * 2,
            f"{prefix}.self_attn.k_proj.weight": w(kv_rows, input_width) * 2,
            f"{prefix}.self_attn.v_proj.weight": w(kv_rows, input_width),
            f"{prefix}.self_attn.o_proj.weight": w(hidden, q_rows),
            f"{prefix}.mlp.gate_proj.weight": w(inter, hidden),
            f"{prefix}.mlp.up_proj.weight": w(inter, hidden),
            f"{prefix}.mlp.down_proj.weight": w(hidden, inter),
            f"{prefix}.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen)}


def _write(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(directory / "model.safetensors"))
    return tensors


def write_eagle(directory: Path, seed: int = 0, fc_bias: bool = True, **config_changes) -> dict[str, torch.Tensor]:
    """An EAGLE-1 head (yuhuili/EAGLE-* layout): fc over cat(embedding, feature), layer 0 without
    an input norm, a copy of the embedding that serving ignores, no LM head. Returns its tensors."""
    gen = torch.Generator().manual_seed(seed)
    config = {**TARGET_CONFIG, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              **config_changes}
    hidden = config["hidden_size"]
    tensors = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) * (2 * hidden) ** -0.5 * 2,
               "embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=gen),
               **_layer_tensors("layers.0", hidden, gen, config)}
    if fc_bias:
        tensors["fc.bias"] = 0.1 * torch.randn(hidden, generator=gen)
    return _write(directory, config, tensors)


def write_eagle3(directory: Path, seed: int = 0, **config_changes) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head (the published EAGLE3 layout): `midlayer.*`, fc from the three kept
    states, `norm`, an LM head over a draft vocabulary of DRAFT_VOCAB ids placed by `d2t`."""
    gen = torch.Generator().manual_seed(seed)
    config = {**TARGET_CONFIG, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"],
              "model_type": "llama", "draft_vocab_size": DRAFT_VOCAB, "eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS,
              **config_changes}
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    targets = torch.randperm(vocab, generator=gen)[:DRAFT_VOCAB].sort().values
    tensors = {"fc.weight": torch.randn(hidden, 3 * hidden, generator=gen) * (3 * hidden) ** -0.5,
               "norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
               "lm_head.weight": torch.randn(DRAFT_VOCAB, hidden, generator=gen) * 0.5,
               "d2t": targets - torch.arange(DRAFT_VOCAB),
               "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, targets, True),
               "embed_tokens.weight": torch.randn(vocab, hidden, generator=gen),
               "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
               "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
               **_layer_tensors("midlayer", 2 * hidden, gen, config)}
    return _write(directory, config, tensors)
