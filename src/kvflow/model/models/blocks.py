"""The layer blocks decoder families are assembled from.

- `RopeAttention`: q/k/v as one projection, optional q/k RMSNorm, RoPE, paged attention, output
  projection. Its KV spec (full, sliding window, shared with an earlier layer) comes from the
  architecture config, its place in the KV pool from the config's KV layout. Under tensor
  parallelism a rank keeps its heads; a norm over a whole projection of all heads (OLMoE's) keeps
  its heads' channels and all-reduces the sum of squares (`HeadSplitRMSNorm`).
- `DecoderLayer`: the pre-norm residual block x + attn(norm(x)), then + mlp(norm(.)). The residual
  stream is carried beside each layer's output instead of added to it at the end of the layer: the
  next RMSNorm adds it as it normalises (one pass instead of two), and so does the final norm.
- `CausalLM`: the decoder under an LM head (or the tied embedding), and checkpoint loading.
- `make_layers`: a family's layer list, built for the pipeline stage in scope (the layers of other
  stages are `AbsentLayer`s, without weights); `DecoderModel.forward_stage` runs a stage's part.

Every projection is a layer of the linear seam, so quantization and tensor parallelism apply to
every family built from these blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.attention.metadata import AttentionLayerSpec
from kvflow.distributed.parallel_state import HeadSplit, TensorParallel, current_tensor_parallel, split_heads
from kvflow.distributed.pipeline import PipelineStage, current_pipeline_stage
from kvflow.kv_cache_spec import SharedKVSpec
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.attention import Attention
from kvflow.model.layers.embedding import ParallelLMHead
from kvflow.model.layers.linear import QKVParallelLinear, RowParallelLinear
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.layers.reference import Rope
from kvflow.model.layers.rotary import apply_rotary
from kvflow.model.loader.weights import load_named_weights
from kvflow.quant.base import QuantizationConfig, copy_checked, set_weight_attrs

# HF checkpoints store these projections apart; we run them as one matmul each.
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def attention_layer_spec(cfg: ArchConfig, layer_idx: int, scale: float) -> AttentionLayerSpec:
    """The layer's attention shape (this tensor-parallel rank's heads), window and place in the KV pool."""
    group, _ = cfg.kv_layout.places[layer_idx]
    shares = isinstance(cfg.kv_cache_specs()[layer_idx], SharedKVSpec)
    heads = split_heads(cfg.num_heads, cfg.num_kv_heads, current_tensor_parallel(), cfg.architecture)
    return AttentionLayerSpec(heads.num_heads, heads.num_kv_heads, cfg.head_dim, scale, cfg.sliding_windows[layer_idx],
                              kv_group=group, writes_kv=not shares)


class HeadSplitRMSNorm(RMSNorm):
    """An RMSNorm over a whole projection of `total_heads` heads of which this rank holds `heads`,
    from head `first_head` on: the weight keeps those heads' channels, and the mean square is the
    ranks' sums of squares all-reduced. Every rank holds as many channels and every head is held
    by as many ranks (KV heads replicated when fewer than ranks), so the sum over ranks is the
    whole projection's times ranks × channels held / channels in all."""

    def __init__(self, head_dim: int, heads: int, first_head: int, total_heads: int, eps: float,
                 tp: TensorParallel) -> None:
        super().__init__(heads * head_dim, eps)
        self.tp, self.full_size, self.first = tp, total_heads * head_dim, first_head * head_dim
        set_weight_attrs(self.weight, weight_loader=self.load_heads)

    def load_heads(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.full_size,):
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected ({self.full_size},)")
        copy_checked(param.data, loaded.narrow(0, self.first, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        mean_square = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True)) / (x.shape[-1] * self.tp.size)
        return self.weight * (x * torch.rsqrt(mean_square + self.eps)).to(dtype)


def qk_norms(cfg: ArchConfig, qk_norm: str, heads: HeadSplit, has_k: bool,
             norm: type[RMSNorm]) -> tuple[nn.Module, nn.Module | None]:
    """The (q, k) norms of `qk_norm` "per_head" or "whole" for this rank's `heads`; no k norm in
    a layer that reads another layer's KV."""
    d, eps, tp = cfg.head_dim, cfg.rms_norm_eps, current_tensor_parallel()
    if qk_norm == "per_head":
        return norm(d, eps), norm(d, eps) if has_k else None
    if tp.size == 1:
        return norm(cfg.num_heads * d, eps), norm(cfg.num_kv_heads * d, eps) if has_k else None
    if norm is not RMSNorm:
        raise ValueError(f"{cfg.architecture}: a whole-projection q/k norm splits over tensor-parallel ranks only as "
                         f"an RMSNorm, not a {norm.__name__}; use tensor_parallel_size=1")
    q_norm = HeadSplitRMSNorm(d, heads.num_heads, tp.rank * heads.num_heads, cfg.num_heads, eps, tp)
    k_norm = HeadSplitRMSNorm(d, heads.num_kv_heads, heads.first_kv_head, cfg.num_kv_heads, eps, tp) if has_k else None
    return q_norm, k_norm


class RopeAttention(nn.Module):
    """`qk_norm`: None, "per_head" (an RMSNorm over each head of q and k: Qwen3, Gemma 3) or
    "whole" (over all of q and all of k: OLMoE). `norm` builds those norms (whole ones split over
    tensor-parallel ranks are `HeadSplitRMSNorm`s)."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None, prefix: str, *, scale: float | None = None,
                 qk_norm: str | None = None, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        d = cfg.head_dim
        spec = attention_layer_spec(cfg, layer_idx, d**-0.5 if scale is None else scale)
        kv_heads = cfg.num_kv_heads if spec.writes_kv else 0
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, kv_heads, cfg.attention_bias,
                                          quant_config, f"{prefix}.qkv_proj")
        self.sizes = self.qkv_proj.output_sizes  # this rank's q, k, v
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, False, quant_config, f"{prefix}.o_proj")
        self.qk_norm = qk_norm
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norms(cfg, qk_norm, self.qkv_proj.heads, bool(kv_heads), norm)
        self.attn = Attention(spec, backend)

    def forward(self, rope: Rope, hidden: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        q, *kv = self.qkv_proj(hidden).split(self.sizes, dim=-1)
        k, v = kv if kv else (None, None)
        if self.qk_norm == "whole":
            q, k = self.q_norm(q), k if k is None else self.k_norm(k)
        d = self.attn.spec.head_dim
        q, k = q.unflatten(-1, (-1, d)), k if k is None else k.unflatten(-1, (-1, d))
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), k if k is None else self.k_norm(k)
        q, k = apply_rotary(q, k, rope)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

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


class AbsentLayer(nn.Module):
    """A part of the model another pipeline stage holds: no weights, never run."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this part of the model lives on another pipeline stage")


def make_layers(num_layers: int, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """Layers 0..num_layers-1, built (`build(i)`) only where the pipeline stage in scope holds them:
    a stage allocates its own layers' weights, never the whole model's."""
    stage = current_pipeline_stage()
    return nn.ModuleList(build(i) if stage.holds(i) else AbsentLayer() for i in range(num_layers))


class DecoderModel(nn.Module):
    """embed_tokens → layers → norm, with one RoPE table lookup shared by all layers; a family
    sets the four parts (and, where its embedding or RoPE differ, `embed` / `rope_tables` /
    `layer_rope`)."""

    embed_tokens: nn.Module
    rotary: nn.Module
    layers: nn.ModuleList
    norm: RMSNorm

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds`: the first layer's input rows given instead of the tokens' embeddings
        (a prompt's image rows spliced in: kvflow.model.models.idefics3)."""
        hidden, residual = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds, None
        rope = self.rotary(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        normed, _ = self.norm(hidden, residual)
        return normed

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def rope_tables(self, positions: torch.Tensor):
        return self.rotary(positions)

    def layer_rope(self, layer: nn.Module, tables):
        return tables

    def forward_stage(self, stage: PipelineStage, input_ids, positions, kv_caches: list[torch.Tensor | None], meta,
                      carried: tuple[torch.Tensor, torch.Tensor] | None):
        """Pipeline stage `stage`'s part of `forward`: from the tokens (first stage) or from the
        previous stage's (hidden, residual) `carried`, through its layers; the last stage returns
        the normed hidden states, the others (hidden, residual) for the next. The same operations
        on the same numbers as `forward`, so the stages together compute its result bit for bit."""
        hidden, residual = (self.embed(input_ids), None) if stage.is_first else carried
        tables = self.rope_tables(positions)
        for i in stage.layers:
            layer = self.layers[i]
            hidden, residual = layer(self.layer_rope(layer, tables), hidden, residual, kv_caches[i], meta)
        if not stage.is_last:
            return hidden, residual
        normed, _ = self.norm(hidden, residual)
        return normed


class CausalLM(nn.Module):
    """A decoder `model` (with an `embed_tokens`) under the LM head."""

    stacked_params = STACKED_PARAMS
    # How attention normalises q and k before RoPE: None, "per_head" or "whole" (RopeAttention).
    qk_norm: str | None = None

    def __init__(self, cfg: ArchConfig, model: nn.Module, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.config = cfg
        self.model = model
        self.lm_head = (model.embed_tokens if cfg.tie_word_embeddings
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant_config, "lm_head"))

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            return self.model(input_ids, positions, kv_caches, meta)
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """float32 logits, or the head's own dtype with `widen=False` (embedding.compute_logits)."""
        return self.lm_head.compute_logits(hidden, widen)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.config.tie_word_embeddings:  # the head is the embedding
            weights = ((n, w) for n, w in weights if n != "lm_head.weight")
        # A layer that reads another's KV has no k/v projections; checkpoints may still carry them.
        sharing = {f"model.layers.{i}.self_attn.{p}_proj." for i, s in enumerate(self.config.kv_cache_specs())
                   if isinstance(s, SharedKVSpec) for p in "kv"}
        if sharing:
            weights = ((n, w) for n, w in weights if n[:n.rindex(".") + 1] not in sharing)
        absent = tuple(f"{name}." for name, module in self.named_modules() if isinstance(module, AbsentLayer))
        if absent:  # another pipeline stage's layers
            weights = ((n, w) for n, w in weights if not n.startswith(absent))
        load_named_weights(self, weights, self.stacked_params)

    def keep_stage(self, stage: PipelineStage) -> None:
        """Drop what pipeline stage `stage` does not run: the embedding past the first stage (but
        where the last stage's head is that embedding), the final norm and the head before the last."""
        if stage.size == 1:
            return
        tied = self.lm_head is self.model.embed_tokens
        if not stage.is_first and not (tied and stage.is_last):
            self.model.embed_tokens = AbsentLayer()
        if not stage.is_last:
            self.model.norm = AbsentLayer()
            self.lm_head = AbsentLayer()
