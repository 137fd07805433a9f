"""Qwen3-MoE: the Qwen3 decoder (an RMSNorm over each head of q and k) whose MLP is a mixture of
experts (128 of them, 8 per token, in Qwen3-30B-A3B), top-k weights renormalised when
`norm_topk_prob` says so. Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step`
rhythm, keep a dense MLP."""

from __future__ import annotations

from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.moe import SparseMoE
from kvflow.model.models.blocks import CausalLM
from kvflow.model.models.llama import LlamaModel, dense_mlp
from kvflow.quant.base import QuantizationConfig


def qwen3_moe_mlp(cfg: ArchConfig, layer_idx: int, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
    if layer_idx in cfg.moe.dense_layers:
        return dense_mlp(cfg, layer_idx, quant_config, prefix)
    return SparseMoE(cfg.hidden_size, cfg.moe, quant_config, prefix)


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(cfg, LlamaModel(cfg, backend, quant_config, qk_norm="per_head", mlp=qwen3_moe_mlp), quant_config)
