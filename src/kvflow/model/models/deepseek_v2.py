"""DeepSeek-V2 and -V3: multi-head latent attention (MLA) and a mixture of fine-grained experts.

MLA (DeepSeek-V2, §2.1): keys and values of all heads are up-projections of one compressed latent
c = RMSNorm(W_DKV h) of kv_lora_rank numbers; the RoPE part of the key, k_pe, is a separate
projection shared by every head (RoPE does not commute with the up-projection). The cache holds
only [c, k_pe]: 512 + 64 = 576 numbers per token per layer in DeepSeek-V2, where multi-head
attention would hold 2 x 128 heads x 128. The key up-projection W_UK is absorbed into the query
and the value up-projection W_UV applied after attention (`kvflow.attention.mla`), so decoding
never expands per-head K/V over the context. The query goes through its own low-rank bottleneck
(q_lora_rank) where the config has one.

MoE: the first `first_k_dense_replace` layers keep a dense MLP; the others route each token to
k of many small experts and add always-on shared experts. V2 scores experts with a softmax
(optionally limited to the best groups of experts); V3 with a sigmoid plus a per-expert bias that
only steers the choice (`kvflow.model.layers.moe.route`).

The checkpoint's RoPE dimensions come in interleaved pairs (x0, x1), (x2, x3), ...; they are
de-interleaved before the rotate-half RoPE, which rotates the same pairs.

Tensor parallelism splits MLA by heads: q_proj / q_b_proj and kv_b_proj keep the rank's heads'
rows (their outputs are head-major), o_proj their input channels, so a rank absorbs and attends
for its heads only and o_proj's all-reduce sums the heads. The latent path is shared by every head
and so kept whole on every rank (q_a_proj, kv_a_proj_with_mqa and their norms): each rank writes
and reads the whole [c, k_pe] of every token, as at one rank, and its KV pool is the full
model's. The experts split as any mixture does (`kvflow.model.layers.moe`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.attention.mla import mla_attention
from kvflow.distributed.parallel_state import current_tensor_parallel, split_heads
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.embedding import VocabParallelEmbedding
from kvflow.model.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from kvflow.model.layers.mlp import GatedMLP
from kvflow.model.layers.moe import SparseMoE
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.layers.reference import Rope, torch_rotary
from kvflow.model.layers.rotary import RotaryEmbedding, rope_type, yarn_mscale
from kvflow.model.models.blocks import CausalLM, DecoderLayer, DecoderModel, make_layers
from kvflow.quant.base import QuantizationConfig

LATENT_NORM_EPS = 1e-6  # the latent norms use their class default, not the config's rms_norm_eps


class DeepseekV2MLAttention(nn.Module):
    # kv_b_proj never runs on the tokens: its weight is read once and absorbed into the query and
    # output matmuls (`absorbed`), so per-token wrappers around linears (LoRA) must leave it alone.
    indirect_linears = ("kv_b_proj",)

    def __init__(self, cfg: ArchConfig, layer_idx: int, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        m, heads, hidden, bias = cfg.mla, cfg.num_heads, cfg.hidden_size, cfg.attention_bias
        # This rank's query heads; the projections below are sized for all of them and keep its rows.
        self.num_heads = split_heads(heads, 0, current_tensor_parallel(), prefix).num_heads
        self.mla, self.backend = m, backend
        self.kv_group = cfg.kv_layout.places[layer_idx][0]
        qk_head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        self.scale = qk_head_dim**-0.5 * yarn_softmax_mscale(cfg.rope_scaling)
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_head_dim, False, quant_config, f"{prefix}.q_proj")
        else:
            self.q_a_proj = ReplicatedLinear(hidden, m.q_lora_rank, bias, quant_config, f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, heads * qk_head_dim, False, quant_config, f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias, quant_config,
                                                   f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), False,
                                              quant_config, f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(heads * m.v_head_dim, hidden, bias, quant_config, f"{prefix}.o_proj")
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, rank], W_UV [H, v, rank]) of this rank's H heads from kv_b_proj, read
        through its quant method (the layer applied to the identity is W^T), once."""
        if self._absorbed is None:
            m = self.mla
            eye = torch.eye(m.kv_lora_rank, dtype=self.kv_a_layernorm.weight.dtype, device=self.kv_a_layernorm.weight.device)
            w = self.kv_b_proj(eye).view(m.kv_lora_rank, self.num_heads, m.qk_nope_head_dim + m.v_head_dim)
            self._absorbed = (w[..., :m.qk_nope_head_dim].permute(1, 2, 0).contiguous(),
                              w[..., m.qk_nope_head_dim:].permute(1, 2, 0).contiguous())
        return self._absorbed

    def forward(self, rope: Rope, hidden: torch.Tensor, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        m = self.mla
        q = self.q_proj(hidden) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.unflatten(-1, (self.num_heads, -1)).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = self._rotate(q_pe, rope), self._rotate(k_pe[:, None], rope)[:, 0]
        w_uk, w_uv = self.absorbed()
        query = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)
        context = mla_attention(query, torch.cat([latent, k_pe], dim=-1), kv_cache, meta[self.kv_group], self.scale,
                                m.kv_lora_rank, reference=self.backend.name == "torch_reference")
        return self.o_proj(torch.einsum("thr,hvr->thv", context, w_uv).flatten(1))

    def _rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        if self.mla.rope_interleave:  # (x0, x1), (x2, x3), ... → (x0, x2, ...), (x1, x3, ...)
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        return torch_rotary(x, rope)


def yarn_softmax_mscale(scaling: dict | None) -> float:
    """DeepSeek's YaRN correction on the softmax scale, mscale(factor, mscale_all_dim) squared: it
    covers the whole q·k (nope and rope parts), where the factor on cos/sin covers only the rope
    part (and is 1 when mscale == mscale_all_dim, as in DeepSeek's configs). HF applies it for any
    scaling that has mscale_all_dim."""
    if rope_type(scaling) == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def deepseek_mlp(cfg: ArchConfig, layer_idx: int, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
    if layer_idx in cfg.moe.dense_layers:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, quant_config, prefix)
    return SparseMoE(cfg.hidden_size, cfg.moe, quant_config, prefix)


class DeepseekV2Model(DecoderModel):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None,
                 prefix: str = "model") -> None:
        super().__init__()
        if cfg.mla is None or cfg.moe is None:
            raise ValueError("a DeepSeek-V2/V3 config needs kv_lora_rank (MLA) and routed experts")
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, quant_config, f"{prefix}.embed_tokens")
        self.rotary = RotaryEmbedding(cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, cfg.rope_serve_len)
        self.layers = make_layers(cfg.num_layers, lambda i: DecoderLayer(
            cfg, DeepseekV2MLAttention(cfg, i, backend, quant_config, f"{prefix}.layers.{i}.self_attn"),
            deepseek_mlp(cfg, i, quant_config, f"{prefix}.layers.{i}.mlp")))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV2ForCausalLM(CausalLM):
    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # q_proj is its own

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(cfg, DeepseekV2Model(cfg, backend, quant_config), quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # V3 checkpoints carry multi-token-prediction layers past the last decoder layer: unused here.
        n = self.config.num_layers
        super().load_weights((name, w) for name, w in weights if not _layer_at_or_after(name, n))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3 differs in configuration only: sigmoid routing with a choice bias, a query bottleneck."""


def _layer_at_or_after(name: str, n: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= n
