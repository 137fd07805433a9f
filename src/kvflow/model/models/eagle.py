"""EAGLE draft heads: one Llama decoder layer that drafts from the target's hidden states.

EAGLE-1 (Li et al.; the yuhuili/EAGLE-* checkpoints, vLLM's EagleLlamaForCausalLM). The head's
input at position p is the pair (feature f_p, token t_{p+1}): f_p is the target's final hidden
state at p (after its final norm), t_{p+1} the token that followed. Then

    x = fc(cat(embed(t_{p+1}), f_p))              fc: [H, 2H] (a bias where the checkpoint has one)
    a = attn(x) at RoPE position p                 no input norm on this layer
    h = mlp(post_attention_layernorm(a + x)) + (a + x)

h (not normed) is both the feature the head feeds itself at p + 1 and, through the target's LM
head (no final norm), the logits of t_{p+2}.

EAGLE-3 (vLLM's llama_eagle3, the published EAGLE3 checkpoints) drafts from three of the
target's intermediate residual-stream states g_p (the inputs of the layers its config names in
`eagle_aux_hidden_state_layer_ids`, vLLM's numbering: 0 is the embedding), concatenated:

    f = fc(g_p)                                    fc: [H, 3H_target]; the head's own passes feed
                                                   its previous `r` as f and skip fc
    a = attn(cat(input_layernorm(embed(t)), hidden_norm(f)))   q/k/v read 2H
    m = mlp(post_attention_layernorm(a + f))
    r = m + (a + f);  logits = lm_head(norm(r)) over a draft vocabulary, placed at target ids
                      draft id + d2t[draft id] (every other target id -inf)

Both heads share the target's embedding (and EAGLE-1 its LM head): a checkpoint's copy of the
embedding is ignored. The layer is kvflow's own (RopeAttention, GatedMLP), so its attention runs
on the paged KV with any backend and its projections shard under the target's tensor parallel
like any Llama layer's; the features are whole (the target's all-reduce made them so).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.embedding import ParallelLMHead
from kvflow.model.layers.linear import QKVParallelLinear, ReplicatedLinear
from kvflow.model.layers.mlp import GatedMLP
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.layers.rotary import RotaryEmbedding
from kvflow.model.loader.weights import load_named_weights
from kvflow.model.models.blocks import STACKED_PARAMS, RopeAttention

# Checkpoint tensors a head never reads: the target's embedding is used, EAGLE-3's target → draft
# map is not needed to draft (d2t places the draft's logits).
IGNORED_TENSORS = ("embed_tokens.weight", "t2d")


class EagleLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, eagle3: bool) -> None:
        super().__init__()
        prefix, hidden = "layers.0", cfg.hidden_size
        self.self_attn = RopeAttention(cfg, 0, backend, None, f"{prefix}.self_attn")
        if eagle3:  # q, k and v read the embedding and the feature side by side
            self.self_attn.qkv_proj = QKVParallelLinear(2 * hidden, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                                        cfg.attention_bias, None, f"{prefix}.self_attn.qkv_proj")
            self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, None, f"{prefix}.mlp")


class EagleHead(nn.Module):
    """`embed` / `target_logits`: the target's token embedding and LM head (float32 logits);
    `fc_bias`: EAGLE-1's fc has a bias (the checkpoint says); `aux_width`: EAGLE-3's fc input,
    the concatenated intermediate states' width (None: EAGLE-1)."""

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, embed: Callable[[torch.Tensor], torch.Tensor],
                 target_logits: Callable[[torch.Tensor], torch.Tensor], fc_bias: bool = False,
                 aux_width: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.eagle3 = aux_width is not None
        hidden = cfg.hidden_size
        self.embed = embed  # the target's: a bound method, so not a parameter of the head
        self.target_logits = target_logits
        self.fc = ReplicatedLinear(aux_width if self.eagle3 else 2 * hidden, hidden, fc_bias, None, "fc")
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.rope_serve_len)
        self.layers = nn.ModuleList([EagleLayer(cfg, backend, self.eagle3)])
        if self.eagle3:
            self.draft_vocab_size = int(cfg.hf.get("draft_vocab_size") or cfg.vocab_size)
            self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
            self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden, None, "lm_head")
            # draft id → target id offset; a buffer, loaded by hand (ids are not weights)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=False)

    def combine(self, target_states: torch.Tensor) -> torch.Tensor:
        """The feature of a row the target computed: its final hidden state as it is (EAGLE-1), or
        EAGLE-3's fc over its concatenated intermediate states."""
        return self.fc(target_states) if self.eagle3 else target_states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                kv_caches: list[torch.Tensor], meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows the LM head reads, the feature each row hands the head's next pass). `features`:
        a row's f (`combine`d, or the head's own from its previous pass); writes the rows' KV."""
        layer, rope = self.layers[0], self.rotary(positions)
        embedded = self.embed(input_ids)
        if self.eagle3:
            x = torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(features)], dim=-1)
            residual = features
        else:
            x = residual = self.fc(torch.cat([embedded, features], dim=-1))
        attended = layer.self_attn(rope, x, kv_caches[0], meta)
        normed, residual = layer.post_attention_layernorm(attended, residual)
        out = layer.mlp(normed)
        if not self.eagle3:
            out = out + residual
            return out, out
        return self.norm(out, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the target's vocabulary."""
        if not self.eagle3:
            return self.target_logits(hidden)
        draft = self.lm_head.compute_logits(hidden)
        logits = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        logits[:, torch.arange(self.draft_vocab_size, device=draft.device) + self.d2t] = draft
        return logits

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """A checkpoint's tensors (EAGLE-3's `midlayer.*` are layer 0's); a missing or misplaced
        one is an error naming it."""
        if self.eagle3:
            d2t = tensors.get("d2t")
            if d2t is None or tuple(d2t.shape) != (self.draft_vocab_size,) or d2t.is_floating_point():
                raise ValueError(f"an EAGLE-3 checkpoint needs an integer 'd2t' of shape ({self.draft_vocab_size},) "
                                 f"(draft_vocab_size); got {None if d2t is None else (tuple(d2t.shape), d2t.dtype)}")
            targets = torch.arange(self.draft_vocab_size) + d2t
            if targets.min() < 0 or targets.max() >= self.config.vocab_size or targets.unique().numel() != targets.numel():
                raise ValueError(f"'d2t' must map the {self.draft_vocab_size} draft ids to distinct target ids "
                                 f"in [0, {self.config.vocab_size})")
            self.d2t.copy_(d2t)
        load_named_weights(self, _renamed(tensors), STACKED_PARAMS)


def _renamed(tensors: Mapping[str, torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    for name, tensor in tensors.items():
        if name in IGNORED_TENSORS or name == "d2t":
            continue
        yield name.replace("midlayer.", "layers.0.", 1) if name.startswith("midlayer.") else name, tensor


class KeptLayerInputs:
    """The target's residual stream entering the layers `layer_ids` (vLLM's numbering for EAGLE-3:
    id i is layer i's input, the output of layer i − 1; 0 the embedding), kept by forward
    pre-hooks as each forward pass runs, the model's code untouched. Costs one add and one
    [rows, hidden] copy per kept layer and step, only where an EAGLE-3 head is configured. A
    step's fast paths (CUDA graphs, the CPU decode step) run no module, so they run no hook:
    the runner takes the modules' path for such steps."""

    def __init__(self, layers: nn.ModuleList, layer_ids: tuple[int, ...]) -> None:
        self.layer_ids = layer_ids
        self._kept: dict[int, torch.Tensor] = {}
        for layer_id in layer_ids:
            layers[layer_id].register_forward_pre_hook(self._keeper(layer_id))

    def _keeper(self, layer_id: int):
        def keep(module: nn.Module, args: tuple) -> None:
            _, hidden, residual = args[:3]  # DecoderLayer(rope, hidden, residual, kv_cache, meta)
            # A copy: the layer's fused norms add into their residual in place, and the first
            # layer's residual is its input.
            self._kept[layer_id] = hidden.clone() if residual is None else hidden + residual
        return keep

    def take(self) -> torch.Tensor:
        """The last forward pass's kept states, side by side in `layer_ids` order: [rows, k·H]."""
        missing = [i for i in self.layer_ids if i not in self._kept]
        if missing:
            raise RuntimeError(f"the target's forward pass kept no residual stream for layers {missing}")
        kept = torch.cat([self._kept[i] for i in self.layer_ids], dim=-1)
        self._kept.clear()
        return kept
