"""Mixtral: the Llama decoder (with Mistral's optional window) whose MLP is a mixture of eight
experts, two per token, their router weights renormalised over the two (softmax over the chosen
logits). The checkpoint calls the MoE block `block_sparse_moe` and an expert's gate, down and up
projections w1, w2 and w3."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.moe import SparseMoE
from kvflow.model.models.blocks import STACKED_PARAMS, CausalLM
from kvflow.model.models.llama import LlamaModel
from kvflow.quant.base import QuantizationConfig


def mixtral_moe(cfg: ArchConfig, layer_idx: int, quant_config: QuantizationConfig | None, prefix: str) -> SparseMoE:
    return SparseMoE(cfg.hidden_size, cfg.moe, quant_config, prefix)


class MixtralForCausalLM(CausalLM):
    stacked_params = {**STACKED_PARAMS, "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1)}

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(cfg, LlamaModel(cfg, backend, quant_config, mlp=mixtral_moe), quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name.replace(".block_sparse_moe.", ".mlp.").replace(".w2.", ".down_proj."), w)
                             for name, w in weights)
