"""Modified rejection sampling: keep a proposal while the target agrees, keep exactly the target's
distribution.

For each request the proposer guessed tokens d_1..d_k, drawing d_i from a distribution q_i (a
one-hot q for a proposer that looks tokens up instead of sampling them). One target forward pass
gives the target's distribution p_i at each of those positions and p_{k+1} after the last one.
Walking the proposals in order:

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
    at the first rejection, emit a token drawn from normalize(max(p_i - q_i, 0)) and stop;
    if all k are accepted, emit a bonus token drawn from p_{k+1}.

Each emitted token is distributed exactly as p at its position (Leviathan et al., 2023): for any
x, P(x) = q(x)·min(1, p(x)/q(x)) + (1 - Σ_y min(q(y), p(y)))·max(p(x) - q(x), 0)/Z = p(x), since
Z = Σ_y max(p(y) - q(y), 0) is exactly the rejection probability. Greedy requests (p a point mass
on its argmax) reduce to exact matching, so their output is the non-speculative output.

Everything is batched over requests and positions with no per-token Python loop; randomness comes
in as arguments, so the caller decides whose generator draws it (seeded requests own theirs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verification:
    num_accepted: torch.Tensor  # [R] long: leading proposals kept
    final_token: torch.Tensor  # [R] long: the token after them (a correction, or the bonus)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> Verification:
    """
    target_probs [R, K+1, V]: p at each proposal's position; row r's bonus position is
        num_drafts[r] (rows after it are ignored).
    draft_token_ids [R, K] long, num_drafts [R] long (≤ K): row r proposed draft_token_ids[r, :num_drafts[r]].
    draft_probs [R, K, V] or None: the q each proposal was drawn from; None: every proposal is
        certain (one-hot q), as for n-gram lookup.
    greedy [R] bool: verify by exact match against argmax p (the probabilities need no temperature).
    uniforms [R, K] in [0, 1): one acceptance test per proposal.
    noise [R, V] i.i.d. Exp(1): the final draw is argmax(weights / noise), a sample from the
        normalized weights.
    """
    num_rows, k = draft_token_ids.shape
    rows = torch.arange(num_rows, device=target_probs.device)
    drafts = draft_token_ids.clamp(min=0)
    proposed = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]  # [R, K]
    p_draft = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # p_i(d_i)
    if draft_probs is None:
        accept = uniforms < p_draft  # q_i(d_i) = 1
    else:
        # u < p/q without dividing: q(d) > 0 for a token that was drawn from q.
        accept = uniforms * draft_probs.gather(-1, drafts[..., None]).squeeze(-1) < p_draft
    matches = target_probs[:, :k].argmax(dim=-1) == drafts
    accept = torch.where(greedy[:, None], matches, accept) & proposed
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)

    # The final token is drawn at position j = num_accepted: from the residual if proposal j was
    # rejected, from p itself if j is the bonus position.
    p_final = target_probs[rows, num_accepted]  # [R, V]
    rejected = num_accepted < num_drafts
    at = num_accepted.clamp(max=max(k - 1, 0))
    if k == 0:
        weights = p_final
    else:
        if draft_probs is None:
            q_final = torch.zeros_like(p_final).scatter_(1, drafts[rows, at][:, None], 1.0)
        else:
            q_final = draft_probs[rows, at]
        residual = (p_final - q_final).clamp(min=0)
        # p = q makes a rejection impossible; rounding can still leave an all-zero residual.
        usable = rejected[:, None] & (residual.sum(dim=-1, keepdim=True) > 0)
        weights = torch.where(usable, residual, p_final)
    sampled = (weights / noise).argmax(dim=-1)
    final = torch.where(greedy, p_final.argmax(dim=-1), sampled)
    return Verification(num_accepted, final)


def verify_greedy(target_ids: torch.Tensor, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor) -> Verification:
    """Every request greedy: keep the proposals that equal the target's argmax [R, K+1], then
    emit its argmax where they diverge (or after the last). No probabilities needed."""
    k = draft_token_ids.shape[1]
    proposed = torch.arange(k, device=draft_token_ids.device)[None, :] < num_drafts[:, None]
    num_accepted = ((target_ids[:, :k] == draft_token_ids) & proposed).long().cumprod(dim=-1).sum(dim=-1)
    final = target_ids.gather(1, num_accepted[:, None]).squeeze(1)
    return Verification(num_accepted, final)


def pad_rows(flat: torch.Tensor, counts: list[int], width: int) -> torch.Tensor:
    """Ragged rows [Σ counts, ...] → [len(counts), width, ...], each request's rows first; the
    padding repeats its last row (never read). Every count is at least 1."""
    sizes = torch.tensor(counts, device=flat.device)
    starts = sizes.cumsum(0) - sizes
    offsets = torch.minimum(torch.arange(width, device=flat.device)[None, :], sizes[:, None] - 1)
    return flat[starts[:, None] + offsets]
