"""Gemma 3 (text): local attention interleaved with global attention.

- Five of every six layers attend within a sliding window (512 tokens in the 270M and 1B models,
  1024 in larger ones) and rotate with a local RoPE base (10,000); every sixth layer is global,
  with its own base (1,000,000) and the model's RoPE scaling. Local layers keep O(window) KV.
- q and k get a per-head RMSNorm; the attention scale is query_pre_attn_scalar^-1/2.
- Each sub-block is sandwiched between two norms: x + post_norm(block(pre_norm(x))).
- Norms scale by (1 + w); loading adds the 1 once, so the shared RMSNorm (and its fused kernel)
  runs unchanged.
- The embedding is multiplied by sqrt(hidden_size) in the model dtype; the MLP is GeLU(tanh)-gated;
  logits are soft-capped (cap · tanh(logits / cap)) where the config asks for it.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.embedding import VocabParallelEmbedding
from kvflow.model.layers.mlp import GatedMLP
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.layers.reference import Rope
from kvflow.model.layers.rotary import RotaryEmbedding
from kvflow.model.models.blocks import CausalLM, DecoderModel, RopeAttention, make_layers
from kvflow.quant.base import QuantizationConfig, copy_checked


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm scales by (1 + w): the parameter holds 1 + w, added when w is loaded."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.weight.weight_loader = self._load_one_plus

    @staticmethod
    def _load_one_plus(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param.data, loaded.float() + 1.0)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.is_local = cfg.sliding_windows[layer_idx] is not None
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = RopeAttention(cfg, layer_idx, backend, quant_config, f"{prefix}.self_attn",
                                       scale=cfg.hf["query_pre_attn_scalar"] ** -0.5, qk_norm=Gemma3ForCausalLM.qk_norm,
                                       norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = GatedMLP(size, cfg.intermediate_size, quant_config, f"{prefix}.mlp", cfg.hf["hidden_activation"])
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, rope: Rope, hidden, residual, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """As the Llama layer: hidden is not yet added to the residual stream, the next norm adds it."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rope, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(DecoderModel):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None,
                 prefix: str = "model") -> None:
        super().__init__()
        if cfg.hf.get("attn_logit_softcapping") is not None:
            raise ValueError("Gemma 3 with attn_logit_softcapping is not supported")
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, quant_config, f"{prefix}.embed_tokens")
        self.embed_scale = cfg.hidden_size**0.5
        self.global_rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                             cfg.rope_serve_len)
        self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, _local_rope_theta(cfg), None)
        self.layers = make_layers(cfg.num_layers, lambda i: Gemma3DecoderLayer(cfg, i, backend, quant_config,
                                                                               f"{prefix}.layers.{i}"))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden, residual = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype), None
        local, global_ = self.local_rotary(positions), self.global_rotary(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(local if layer.is_local else global_, hidden, residual, kv_cache, meta)
        normed, _ = self.norm(hidden, residual)
        return normed

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def rope_tables(self, positions: torch.Tensor):
        return self.local_rotary(positions), self.global_rotary(positions)

    def layer_rope(self, layer: nn.Module, tables):
        return tables[0] if layer.is_local else tables[1]


class Gemma3ForCausalLM(CausalLM):
    qk_norm = "per_head"

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(cfg, Gemma3Model(cfg, backend, quant_config), quant_config)
        self.final_logit_softcapping = cfg.hf.get("final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        # The softcap is computed in float32 whatever the caller asks: tanh saturates, and in
        # bfloat16 it would tie logits that differ.
        logits = super().compute_logits(hidden, widen or self.final_logit_softcapping is not None)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


def _local_rope_theta(cfg: ArchConfig) -> float:
    local = (cfg.hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    return float(local.get("rope_theta", cfg.hf["rope_local_base_freq"]))
