"""OLMoE: a Llama-style decoder whose q and k are RMS-normalised over the whole projection (all
heads at once, before splitting into heads) and whose MLP is a mixture of 64 experts, 8 per token,
the top-k softmax weights not renormalised unless `norm_topk_prob`."""

from __future__ import annotations

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.moe import SparseMoE
from kvflow.model.models.blocks import CausalLM
from kvflow.model.models.llama import LlamaModel
from kvflow.quant.base import QuantizationConfig


def olmoe_moe(cfg: ArchConfig, layer_idx: int, quant_config: QuantizationConfig | None, prefix: str) -> SparseMoE:
    return SparseMoE(cfg.hidden_size, cfg.moe, quant_config, prefix)


class OlmoeForCausalLM(CausalLM):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        if cfg.hf.get("clip_qkv") is not None:
            raise ValueError("OLMoE with clip_qkv is not supported")
        super().__init__(cfg, LlamaModel(cfg, backend, quant_config, qk_norm="whole", mlp=olmoe_moe), quant_config)
