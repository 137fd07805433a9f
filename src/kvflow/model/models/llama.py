"""Llama, and the relatives that differ from it only in details the config names.

Mistral adds a sliding window and Qwen2 a bias on the q/k/v projections (both read from the
config by the attention block); Qwen3 adds an RMSNorm over each head of q and k. With
`num_kv_shared_layers` = n in its config, the last n layers read the KV cache of the last layer
before them instead of writing their own (cross-layer KV sharing, as Gemma 3n does): their k/v
projections are absent and the pool shrinks by n / num_layers.

Each layer sees the whole flat batch `[T, hidden]`; only attention looks at which request a
token belongs to, through the attention metadata (selective batching).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.embedding import VocabParallelEmbedding
from kvflow.model.layers.mlp import GatedMLP
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.layers.rotary import RotaryEmbedding
from kvflow.model.models.blocks import CausalLM, DecoderLayer, DecoderModel, RopeAttention, make_layers
from kvflow.quant.base import QuantizationConfig

# (config, layer index, quant config, prefix) → the layer's feed-forward block
MLPFactory = Callable[[ArchConfig, int, QuantizationConfig | None, str], nn.Module]


def dense_mlp(cfg: ArchConfig, layer_idx: int, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, quant_config, prefix)


class LlamaModel(DecoderModel):
    """The Llama decoder; `qk_norm` and `mlp` are what its relatives change (the MoE families
    build it with a mixture of experts as the MLP)."""

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None,
                 qk_norm: str | None = None, mlp: MLPFactory = dense_mlp, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, quant_config, f"{prefix}.embed_tokens")
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.rope_serve_len)
        self.layers = make_layers(cfg.num_layers, lambda i: DecoderLayer(
            cfg, RopeAttention(cfg, i, backend, quant_config, f"{prefix}.layers.{i}.self_attn", qk_norm=qk_norm),
            mlp(cfg, i, quant_config, f"{prefix}.layers.{i}.mlp")))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(cfg, LlamaModel(cfg, backend, quant_config), quant_config)


class Qwen3ForCausalLM(CausalLM):
    qk_norm = "per_head"

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(cfg, LlamaModel(cfg, backend, quant_config, qk_norm=self.qk_norm), quant_config)
