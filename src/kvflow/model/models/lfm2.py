"""LFM2 (transformers' `Lfm2ForCausalLM`, Liquid AI's hybrid): a pre-norm decoder whose layers attend
where `layer_types` says and run a gated short convolution elsewhere:

    embed_tokens → N × (x + mix(operator_norm(x)), then + feed_forward(ffn_norm(.))) → embedding_norm

`mix` is attention (kvflow's RopeAttention with an RMSNorm over each head of q and k before RoPE,
as Qwen3's) in the attention layers and `short_conv.ShortConv` in the others; every layer has the
SwiGLU MLP, its width from the block_* fields (`arch_config.lfm2_mlp_size`). Attention layers keep
KV blocks of their group as any model's; a convolution layer's state (its last L-1 inputs per
channel) is in the request's state slot (`mamba2.PooledStates.update`), a pool apart from the
blocks (kv_cache_spec: a hybrid's states; in a model of convolutions only, as in Mamba-2, the
states are the pool's blocks). Despite its name, `embedding_norm` is the final norm.

Parameter names are HF's, read under kvflow's where its blocks name them otherwise
(`self_attn.out_proj` → `o_proj`, `q_layernorm`/`k_layernorm` → `q_norm`/`k_norm`,
`feed_forward.w1`/`w3`/`w2` → gate/up/down); every projection is the linear seam's, so
quantization applies to all of them. One rank and one pipeline stage only (`short_conv` says why
it does not shard yet).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.embedding import VocabParallelEmbedding
from kvflow.model.layers.mlp import GatedMLP
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.layers.reference import Rope
from kvflow.model.layers.rotary import RotaryEmbedding
from kvflow.model.layers.short_conv import ShortConv
from kvflow.model.models.blocks import CausalLM, RopeAttention
from kvflow.model.models.mamba2 import PooledStates, forward_with_states, refuse_parallel, state_group
from kvflow.quant.base import QuantizationConfig

# (HF's part of a parameter name, the part kvflow's blocks name the same tensor by)
_RENAMED = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."), (".feed_forward.w1.", ".feed_forward.gate_proj."),
            (".feed_forward.w3.", ".feed_forward.up_proj."), (".feed_forward.w2.", ".feed_forward.down_proj."))


class Lfm2Layer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attends = layer_idx in cfg.attention_layers
        if self.attends:
            self.self_attn = RopeAttention(cfg, layer_idx, backend, quant_config, f"{prefix}.self_attn",
                                           qk_norm=Lfm2ForCausalLM.qk_norm)
        else:
            self.conv = ShortConv(cfg.hidden_size, cfg.recurrent_state.conv_kernel, bool(cfg.hf["conv_bias"]),
                                  quant_config, f"{prefix}.conv")
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, quant_config, f"{prefix}.feed_forward")

    def forward(self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None, cache: torch.Tensor, meta,
                states: PooledStates | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As `blocks.DecoderLayer.forward`; `cache` is the layer's KV, or its state slots."""
        if residual is None:
            residual, hidden = hidden, self.operator_norm(hidden)
        else:
            hidden, residual = self.operator_norm(hidden, residual)
        hidden = self.self_attn(rope, hidden, cache, meta) if self.attends else self._convolve(hidden, cache, states)
        hidden, residual = self.ffn_norm(hidden, residual)
        return self.feed_forward(hidden), residual

    def _convolve(self, normed: torch.Tensor, cache: torch.Tensor, states: PooledStates) -> torch.Tensor:
        """The short convolution over the step's rows, each request from its state in its slot of
        `cache`, the new states written back there."""
        return states.update(cache, lambda rows: self.conv(normed, self.conv.state_view(rows), states.query_lens))


class Lfm2Model(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, quant_config, "model.embed_tokens")
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.rope_serve_len)
        self.layers = nn.ModuleList(Lfm2Layer(cfg, i, backend, quant_config, f"model.layers.{i}")
                                    for i in range(cfg.num_layers))
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # None when every layer attends, as a config without layer_types says by default.
        self.state_group = state_group(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta) -> torch.Tensor:
        return forward_with_states(self, input_ids, positions, kv_caches, meta, self.embedding_norm)


class Lfm2ForCausalLM(CausalLM):
    qk_norm = "per_head"

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        # A rank would keep its channels' states only, which the per-rank KV layout does not size.
        refuse_parallel(cfg.architecture, "its short convolutions' channels and their states, which kvflow "
                        "does not shard yet")
        super().__init__(cfg, Lfm2Model(cfg, backend, quant_config), quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_kvflow_name(name), tensor) for name, tensor in weights)


def _kvflow_name(name: str) -> str:
    for hf_part, ours in _RENAMED:
        if hf_part in name:
            return name.replace(hf_part, ours, 1)
    return name
