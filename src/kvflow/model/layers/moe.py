"""Mixture of experts: a router picks k of E gated MLPs per token; their outputs are mixed by the
router's weights (plus always-on shared experts where the model has them).

Routing, as the seeds write it: g = W_g h, G(h) = normalise(TopK(score(g))), MoE(h) = Σ G_i E_i(h).
The variants differ only in `route`: softmax or sigmoid scores, top-k renormalised or not, a
scaling factor, and DeepSeek's group-limited choice (first the best groups of experts, then the
best experts inside them; V3 picks with a per-expert bias that does not enter the weights).

Execution is grouped by expert: the (token, choice) pairs are sorted by expert, each active expert
runs one matmul pair over all of its tokens, and the weighted outputs are summed back per token.
The only Python loop is over experts that received tokens. Each expert is an ordinary `GatedMLP`
on the linear seam, so quantization applies to experts as to any MLP.

Tensor parallelism splits every expert like a dense MLP (gate/up by output channels, down by
input channels) and keeps the router whole on every rank: the ranks hold the same hidden states,
so they route alike and run the same experts in the same order. The experts' down projections
return partial sums (`reduce_results=False`); weighting and adding them is linear, so the layer
adds the routed and the shared experts' partials and all-reduces once: one collective per layer
whatever the routing, where each expert reducing its own would cost one per active expert.
Expert parallelism (each rank owning E/N whole experts) is not done: with the tokens replicated it
would need no dispatch either, but it needs its own engine argument and per-rank expert loading,
and a rank whose experts are popular would set every step's pace; it pays where experts are many
and narrow (DeepSeek-V3's 256 of 2048 channels, whose slices make thin matmuls), while few wide
experts (Mixtral's 8 of 14336) split by channels as well as dense MLPs do.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.distributed.parallel_state import current_tensor_parallel
from kvflow.model.arch_config import MoEConfig
from kvflow.model.layers.linear import ReplicatedLinear
from kvflow.model.layers.mlp import GatedMLP
from kvflow.quant.base import QuantizationConfig


def route(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] float32, expert ids [T, k]). Ties go to the lower
    expert id, so a token's choice never depends on the rest of the batch."""
    logits = logits.float()
    scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if moe.topk_method in ("group_limited_greedy", "noaux_tc") and moe.num_groups > 1:
        choice = _best_groups_only(choice, moe)
    ids = choice.sort(dim=-1, descending=True, stable=True).indices[:, :moe.experts_per_token]
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def _best_groups_only(choice: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """Mask every expert outside the topk_groups best groups. A group scores by its best expert
    (V2) or by the sum of its two best (V3's noaux_tc)."""
    grouped = choice.view(choice.shape[0], moe.num_groups, -1)
    if moe.topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, :moe.topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    fill = float("-inf") if moe.topk_method == "noaux_tc" else 0.0
    return grouped.masked_fill(~keep[:, :, None], fill).view_as(choice)


class SparseMoE(nn.Module):
    # Children whose linears run on rows other than one per token (each expert on its routed
    # subset): per-token wrappers around linears (LoRA) must leave them alone.
    indirect_linears = ("experts",)

    def __init__(self, hidden_size: int, moe: MoEConfig, quant_config: QuantizationConfig | None, prefix: str,
                 activation: str = "silu") -> None:
        super().__init__()
        self.moe = moe
        self.tp = current_tensor_parallel()
        # The router stays in float: its scores decide which weights run at all.
        self.gate = ReplicatedLinear(hidden_size, moe.num_experts, False, None, f"{prefix}.gate")
        if moe.topk_method == "noaux_tc":
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe.expert_intermediate_size, quant_config, f"{prefix}.experts.{e}", activation,
                     reduce_results=False)
            for e in range(moe.num_experts))
        self.shared_experts = None
        if moe.num_shared_experts:
            self.shared_experts = GatedMLP(hidden_size, moe.expert_intermediate_size * moe.num_shared_experts,
                                           quant_config, f"{prefix}.shared_experts", activation, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe, getattr(self.gate, "e_score_correction_bias", None))
        out = grouped_experts(x, weights, ids, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)  # this rank's partial sums of every expert it ran, reduced once


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """Σ_k weights[t, k] · experts[ids[t, k]](x[t]), one call per active expert over its tokens."""
    k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert, tokens in order
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # one host sync per layer
    tokens = order // k
    grouped = x[tokens]
    outputs = torch.empty_like(grouped)
    start = 0
    for expert, count in zip(experts, counts):
        if count:
            outputs[start:start + count] = expert(grouped[start:start + count])
            start += count
    outputs = outputs * weights.flatten()[order, None].to(outputs.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, outputs)
