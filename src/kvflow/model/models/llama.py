"""The Llama decoder, and its close relatives that differ by a flag.

Mistral adds a sliding window, Qwen2 a bias on the q/k/v projections, Qwen3 an RMSNorm over each
head of q and k. Each layer sees the whole flat batch `[T, hidden]`; only attention looks at
which request a token belongs to, through the attention metadata (selective batching).

The residual stream is carried beside each layer's output instead of added to it at the end of
the layer: the next RMSNorm adds it as it normalises (one pass instead of two), and so does the
model's final norm.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.activation import silu_and_mul
from kvflow.model.layers.attention import Attention
from kvflow.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.layers.rotary import Rope, RotaryEmbedding, apply_rotary
from kvflow.model.loader.weights import load_named_weights
from kvflow.quant.base import QuantizationConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        d = cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias,
                                          quant_config, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, False, quant_config, f"{prefix}.o_proj")
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        spec = AttentionLayerSpec(cfg.num_heads, cfg.num_kv_heads, d, d**-0.5, cfg.sliding_windows[layer_idx])
        self.attn = Attention(spec, backend)

    def forward(self, rope: Rope, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        d = self.attn.spec.head_dim
        q, k = q.unflatten(-1, (-1, d)), k.unflatten(-1, (-1, d))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, rope)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False,
                                                       quant_config, f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False,
                                           quant_config, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx, backend, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, quant_config, f"{prefix}.mlp")

    def forward(
        self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache, meta,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's output, not yet added to the residual stream; the first
        layer gets the embeddings and no residual. Returns (output, residual stream)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None,
                 prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, quant_config, f"{prefix}.embed_tokens")
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, backend, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        normed, _ = self.norm(hidden, residual)
        return normed


class LlamaForCausalLM(nn.Module):
    # HF checkpoints store these projections apart; we run them as one matmul each.
    stacked_params = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, backend, quant_config)
        self.lm_head = (self.model.embed_tokens if cfg.tie_word_embeddings
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant_config, "lm_head"))

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.config.tie_word_embeddings:  # the head is the embedding
            weights = ((n, w) for n, w in weights if n != "lm_head.weight")
        load_named_weights(self, weights, self.stacked_params)
