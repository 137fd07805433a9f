"""Mamba-2 (transformers' `Mamba2ForCausalLM`): a stack of Mamba-2 mixers, no attention, no KV cache.

    embeddings → N × (x + mixer(RMSNorm(x))) → norm_f → LM head (or the tied embedding)

A request's memory is one `MambaState` per layer (`Mamba2State`), of a size fixed by the config;
`forward` takes every request's state and returns the new ones (the mixer's contract,
kvflow.model.layers.mamba2_mixer), so whoever runs the model holds them: a chunked prefill is
several calls, each from the states the last returned.

The residual stream is float32 when the config says `residual_in_fp32` (its default, as in every
published checkpoint), as in HF: each layer's norm reads it rounded to the model dtype, and its
mixer's output is added in float32.

Parameter names are HF's (`backbone.embeddings`, `backbone.layers.N.norm`, `backbone.layers.N.mixer.*`,
`backbone.norm_f`, `lm_head`), so a checkpoint loads by name; the older `backbone.embedding` is
read as `backbone.embeddings`, as HF does. One rank and one pipeline stage only (the mixer's
docstring says why it does not shard).

The engine serves it as `ServedMamba2ForCausalLM`: each request's states live in its block of the
pool's state group (kv_cache_spec.MambaStateSpec), read before the step and written after it.
`PooledStates` is that reading and writing, for any model with state layers (Bamba's mixers,
LFM2's short convolutions too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.distributed.parallel_state import current_tensor_parallel
from kvflow.distributed.pipeline import PipelineStage, current_pipeline_stage
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.model.layers.mamba2_mixer import Mamba2Mixer, MambaState, MixerConfig
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.loader.weights import load_named_weights
from kvflow.quant.base import QuantizationConfig

# One request's state: its MambaState in each layer, in layer order.
Mamba2State = tuple[MambaState, ...]


@dataclass(frozen=True)
class Mamba2Config:
    """The model's shape, read from an HF Mamba2 config.json dict."""

    mixer: MixerConfig
    vocab_size: int
    num_layers: int
    eps: float
    residual_in_fp32: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, config: Mapping) -> Mamba2Config:
        for key in ("vocab_size", "num_hidden_layers"):
            if key not in config:
                raise ValueError(f"config.json is missing {key!r}")
        mixer = MixerConfig.from_hf(config)
        return cls(mixer=mixer, vocab_size=int(config["vocab_size"]), num_layers=int(config["num_hidden_layers"]),
                   eps=mixer.eps, residual_in_fp32=bool(config.get("residual_in_fp32", True)),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))


class Mamba2Layer(nn.Module):
    def __init__(self, cfg: Mamba2Config, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.mixer.hidden_size, cfg.eps)
        self.mixer = Mamba2Mixer(cfg.mixer, quant_config, f"{prefix}.mixer")


class Mamba2Backbone(nn.Module):
    def __init__(self, cfg: Mamba2Config, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        hidden = cfg.mixer.hidden_size
        self.embeddings = VocabParallelEmbedding(cfg.vocab_size, hidden, quant_config, "backbone.embeddings")
        self.layers = nn.ModuleList(Mamba2Layer(cfg, quant_config, f"backbone.layers.{i}")
                                    for i in range(cfg.num_layers))
        self.norm_f = RMSNorm(hidden, cfg.eps)


class Mamba2ForCausalLM(nn.Module):
    def __init__(self, cfg: Mamba2Config, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        refuse_parallel()
        self.config = cfg
        self.backbone = Mamba2Backbone(cfg, quant_config)
        self.lm_head = (self.backbone.embeddings if cfg.tie_word_embeddings
                        else ParallelLMHead(cfg.vocab_size, cfg.mixer.hidden_size, quant_config, "lm_head"))

    def initial_state(self, device: torch.device | str | None = None) -> Mamba2State:
        """A request's state before its first token (conv state in the model dtype)."""
        dtype = self.backbone.norm_f.weight.dtype
        device = self.backbone.norm_f.weight.device if device is None else device
        return tuple(MambaState.zeros(self.config.mixer, dtype, device) for _ in range(self.config.num_layers))

    def forward(self, input_ids: torch.Tensor, states: Sequence[Mamba2State],
                token_counts: Sequence[int]) -> tuple[torch.Tensor, list[Mamba2State]]:
        """A flat batch of requests: input_ids [sum(token_counts)], request r's `token_counts[r]`
        tokens in order, from `states[r]` (a prompt's first chunk from `initial_state()`). Returns
        (the final norm's hidden states [T, hidden], each request's state after its tokens); the
        given states are not changed."""
        self._check_batch(input_ids, states, token_counts)
        per_layer: list[list[MambaState]] = []

        def mix(i: int, mixer: Mamba2Mixer, normed: torch.Tensor) -> torch.Tensor:
            out, layer_states = mixer(normed, [s[i] for s in states], token_counts)
            per_layer.append(layer_states)
            return out
        hidden = self.run_layers(input_ids, mix)
        return hidden, [tuple(layer_states[r] for layer_states in per_layer) for r in range(len(states))]

    def run_layers(self, input_ids: torch.Tensor, mix) -> torch.Tensor:
        """embeddings → each layer's x + mix(i, its mixer, RMSNorm(x)) → norm_f; `mix` runs the
        mixer with the layer's states wherever its caller keeps them."""
        dtype = self.backbone.norm_f.weight.dtype
        stream = self.backbone.embeddings(input_ids)
        if self.config.residual_in_fp32:
            stream = stream.float()
        for i, layer in enumerate(self.backbone.layers):
            stream = stream + mix(i, layer.mixer, layer.norm(stream.to(dtype)))
        return self.backbone.norm_f(stream.to(dtype))

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """float32 logits, or the head's own dtype with `widen=False` (embedding.compute_logits)."""
        return self.lm_head.compute_logits(hidden, widen)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.config.tie_word_embeddings
        renamed = ((name.replace("backbone.embedding.", "backbone.embeddings.", 1), tensor) for name, tensor in weights)
        load_named_weights(self, ((n, w) for n, w in renamed if not (tied and n == "lm_head.weight")), {})

    def _check_batch(self, input_ids: torch.Tensor, states: Sequence[Mamba2State], token_counts: Sequence[int]) -> None:
        """Errors naming the argument: counts that are not positive or do not add up to the
        tokens, a state per request missing, or a state not of this model's shape."""
        if len(states) != len(token_counts):
            raise ValueError(f"states has {len(states)} entries but token_counts {len(token_counts)}: one per request")
        if any(not isinstance(n, int) or n < 1 for n in token_counts):
            raise ValueError(f"token_counts must be positive integers; got {list(token_counts)}")
        if input_ids.dim() != 1 or input_ids.shape[0] != sum(token_counts):
            raise ValueError(f"input_ids must be one flat row of sum(token_counts) = {sum(token_counts)} tokens; "
                             f"got shape {tuple(input_ids.shape)}")
        layers = self.backbone.layers
        for r, state in enumerate(states):
            if len(state) != len(layers):
                raise ValueError(f"states[{r}] has {len(state)} layer states; the model has {len(layers)} layers")
            for i, (layer_state, layer) in enumerate(zip(state, layers)):
                layer.mixer.check_state(layer_state, f"states[{r}][{i}]")


class ServedMamba2ForCausalLM(nn.Module):
    """Mamba2ForCausalLM as the engine runs a model: `forward(input_ids, positions, kv_caches, attn)`.
    Request r's states are in block `attn[0].block_tables[r, 0]` of every layer's pool tensor
    (`PooledStates`). Positions are not read: the state is all the model knows of the past."""

    def __init__(self, arch: ArchConfig, backend=None, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.mamba = Mamba2ForCausalLM(Mamba2Config.from_hf(arch.hf), quant_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn: tuple[AttentionMetadata, ...]) -> torch.Tensor:
        states = PooledStates.of_step(attn[0])
        return self.mamba.run_layers(input_ids, lambda i, mixer, normed: states.mix(mixer, normed, kv_caches[i]))

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        return self.mamba.compute_logits(hidden, widen)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.mamba.load_weights(weights)

    def keep_stage(self, stage: PipelineStage) -> None:
        """One stage only: Mamba2ForCausalLM refuses more when built."""


MIXERS_DO_NOT_SHARD = "its Mamba-2 mixers' in_proj, whose interleaved per-head and per-group outputs it does not shard"


def refuse_parallel(architecture: str = "Mamba2ForCausalLM", unsharded: str = MIXERS_DO_NOT_SHARD) -> None:
    """A model with recurrent state runs on one rank and one pipeline stage; `unsharded`: what a
    rank split would cut that the model does not shard (Mamba-2's mixers: the mixer's docstring)."""
    tp, stage = current_tensor_parallel(), current_pipeline_stage()
    if tp.size > 1:
        raise ValueError(f"{architecture} runs on one rank: tensor_parallel_size={tp.size} would split {unsharded}; "
                         "use tensor_parallel_size=1")
    if stage.size > 1:
        raise ValueError(f"{architecture} runs as one pipeline stage: pipeline_parallel_size={stage.size} "
                         "is not supported for it; use pipeline_parallel_size=1")


@dataclass(frozen=True)
class PooledStates:
    """One step's requests' states in the pool: request r's are in slot `slots[r]` (its state
    group's table, `block_tables[r, 0]`) of each state layer's tensor [1, slots, elements], float32.
    A request computing from position 0 (its chunk is its whole sequence so far) starts from
    zeros, whatever its slot held before. `update` is that gathering and writing back for any
    state layer (LFM2's short convolutions); `mix` runs a Mamba-2 mixer through it, its rows the
    convolution's inputs [conv_dim, conv_kernel], then the scan state [heads, head_dim, state_size]."""

    slots: torch.Tensor
    fresh: list[int]  # requests starting from zeros
    query_lens: list[int]
    decode: bool  # one token per request: the states stepped stacked, in place

    @classmethod
    def of_step(cls, meta: AttentionMetadata) -> PooledStates:
        slots = meta.block_tables[:, 0]
        fresh = [r for r, (q, n) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)) if q == n]
        return cls(slots, fresh, meta.query_lens_cpu, all(n == 1 for n in meta.query_lens_cpu))

    def update(self, cache: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Gather the step's requests' rows [R, elements] of `cache` (a fresh request's zeroed),
        call `run(rows)`, which returns the layer's output and leaves each request's new state in
        its row, and write the rows back to their slots. Returns the output."""
        pool = cache[0]
        rows = pool[self.slots]  # the step's copy: `run` may update views of it in place
        if self.fresh:
            rows[self.fresh] = 0.0
        out = run(rows)
        pool[self.slots] = rows
        return out

    def mix(self, mixer: Mamba2Mixer, normed: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """Run `mixer` over the step's rows `normed` from the states in `cache`, and write the new
        states back. A decode step steps them stacked, in place (no state object per request); one
        with prompt chunks hands the mixer a state per request."""
        return self.update(cache, partial(self._mix_rows, mixer, normed))

    def _mix_rows(self, mixer: Mamba2Mixer, normed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        conv, ssm = _split(mixer.cfg, rows, normed.dtype)
        if self.decode:
            out, conv, _ = mixer.decode_stacked(normed, conv, ssm)  # ssm stepped in place
        else:
            out, states = mixer(normed, [MambaState(c, h) for c, h in zip(conv, ssm)], self.query_lens)
            conv, ssm[:] = torch.stack([s.conv for s in states]), torch.stack([s.ssm for s in states])
        rows[:, :mixer.cfg.conv_dim * mixer.cfg.conv_kernel] = conv.flatten(1)
        return out


def state_group(cfg: ArchConfig) -> int | None:
    """The KV group whose tables hold a hybrid's state slots (one spec for every layer that does
    not attend); None when every layer attends."""
    stateful = [i for i in range(cfg.num_layers) if i not in cfg.attention_layers]
    return cfg.kv_layout.places[stateful[0]][0] if stateful else None


def forward_with_states(decoder: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                        kv_caches: list[torch.Tensor], meta, final_norm: nn.Module) -> torch.Tensor:
    """A hybrid decoder's step (Bamba, LFM2): the step's state slots read once (`PooledStates`),
    each layer given its KV or its slots and them, then the final norm. `decoder` has
    `embed_tokens`, `rotary`, `layers` and `state_group`."""
    states = None if decoder.state_group is None else PooledStates.of_step(meta[decoder.state_group])
    hidden, residual = decoder.embed_tokens(input_ids), None
    rope = decoder.rotary(positions)
    for layer, cache in zip(decoder.layers, kv_caches):
        hidden, residual = layer(rope, hidden, residual, cache, meta, states)
    normed, _ = final_norm(hidden, residual)
    return normed


def _split(cfg: MixerConfig, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool rows [R, elements] → (conv inputs [R, conv_dim, K] in the model's `dtype`, the scan
    states [R, heads, head_dim, state_size]: a view of `rows`)."""
    requests, conv_elements = rows.shape[0], cfg.conv_dim * cfg.conv_kernel
    conv = rows[:, :conv_elements].view(requests, cfg.conv_dim, cfg.conv_kernel).to(dtype)
    return conv, rows[:, conv_elements:].view(requests, cfg.num_heads, cfg.head_dim, cfg.state_size)
