"""Bamba (transformers' `BambaForCausalLM`, IBM's serial hybrid): a Llama decoder whose layers run
a Mamba-2 mixer where Llama attends, but for the layers `attn_layer_indices` names:

    embed_tokens → N × (x + mix(input_layernorm(x)), then + feed_forward(pre_ff_layernorm(.))) → final_layernorm

`mix` is attention (kvflow's RopeAttention, RoPE over the first half of each head: Bamba's
partial_rotary_factor of 0.5) in the attention layers and kvflow's Mamba-2 mixer in the others;
every layer has the gated MLP. Attention layers keep KV blocks of their group, as any model's; a
mixer layer's state is in the request's state slot (`mamba2.PooledStates`), a pool apart from the
blocks (kv_cache_spec: a hybrid's states). The residual stream is carried beside each layer's
output as in `blocks.DecoderLayer`.

Parameter names are HF's (`model.layers.N.mamba.*`, `.self_attn.{q,k,v,o}_proj`,
`.feed_forward.{gate,up,down}_proj`, `.input_layernorm`, `.pre_ff_layernorm`,
`model.final_layernorm`), so a checkpoint loads by name. Projections are the linear seam's, so
quantization applies to them all; one rank and one pipeline stage only, since the mixers do not
shard (`mamba2.refuse_parallel`).
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig, bamba_mixer_config
from kvflow.model.layers.embedding import VocabParallelEmbedding
from kvflow.model.layers.mamba2_mixer import Mamba2Mixer, MixerConfig
from kvflow.model.layers.mlp import GatedMLP
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.layers.reference import Rope
from kvflow.model.layers.rotary import RotaryEmbedding, apply_rotary
from kvflow.model.models.blocks import CausalLM, RopeAttention
from kvflow.model.models.mamba2 import PooledStates, forward_with_states, refuse_parallel, state_group
from kvflow.quant.base import QuantizationConfig


def rotary_dim(cfg: ArchConfig) -> int:
    """The channels of each head RoPE turns: BambaConfig fixes partial_rotary_factor at 0.5."""
    factor = float((cfg.hf.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5))
    return int(cfg.head_dim * factor)


class PartialRopeAttention(RopeAttention):
    """RopeAttention turning only the first `rotary_dim` channels of each head (the rest pass
    as they are), as HF's partial rotary does."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__(cfg, layer_idx, backend, quant_config, prefix)
        self.rotary_dim = rotary_dim(cfg)

    def forward(self, rope: Rope, hidden: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.sizes, dim=-1)
        d, r = self.attn.spec.head_dim, self.rotary_dim
        q, k = q.unflatten(-1, (-1, d)), k.unflatten(-1, (-1, d))
        q_turned, k_turned = apply_rotary(q[..., :r].contiguous(), k[..., :r].contiguous(), rope)
        q, k = torch.cat([q_turned, q[..., r:]], dim=-1), torch.cat([k_turned, k[..., r:]], dim=-1)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class BambaLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, mixer: MixerConfig, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attends = layer_idx in cfg.attention_layers
        if self.attends:
            self.self_attn = PartialRopeAttention(cfg, layer_idx, backend, quant_config, f"{prefix}.self_attn")
        else:
            self.mamba = Mamba2Mixer(mixer, quant_config, f"{prefix}.mamba")
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, quant_config, f"{prefix}.feed_forward")

    def forward(self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None, cache: torch.Tensor, meta,
                states: PooledStates) -> tuple[torch.Tensor, torch.Tensor]:
        """As `blocks.DecoderLayer.forward`; `cache` is the layer's KV, or its state slots."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, cache, meta) if self.attends else states.mix(self.mamba, hidden, cache)
        hidden, residual = self.pre_ff_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class BambaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        mixer = MixerConfig.from_hf(bamba_mixer_config(cfg.hf))
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, quant_config, "model.embed_tokens")
        self.rotary = RotaryEmbedding(rotary_dim(cfg), cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.rope_serve_len)
        self.layers = nn.ModuleList(BambaLayer(cfg, i, mixer, backend, quant_config, f"model.layers.{i}")
                                    for i in range(cfg.num_layers))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.state_group = state_group(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta) -> torch.Tensor:
        return forward_with_states(self, input_ids, positions, kv_caches, meta, self.final_layernorm)


class BambaForCausalLM(CausalLM):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        refuse_parallel(cfg.architecture)
        biased = [key for key in ("attention_bias", "mlp_bias") if cfg.hf.get(key)]
        if biased:  # no published Bamba has them; kvflow's blocks carry no o_proj or MLP bias
            raise ValueError(f"{cfg.architecture}: {', '.join(biased)}=true is not supported")
        if len(cfg.attention_layers) == cfg.num_layers:
            raise ValueError(f"{cfg.architecture}: attn_layer_indices names every layer, leaving no Mamba-2 layer; "
                             "such a checkpoint is a Llama with partial RoPE, which kvflow does not serve as Bamba")
        super().__init__(cfg, BambaModel(cfg, backend, quant_config), quant_config)
