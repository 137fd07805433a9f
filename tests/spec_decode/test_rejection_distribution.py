"""The rejection sampler keeps the target's distribution exactly, with no model involved.

Crafted target and draft distributions over a small vocabulary, one pair per position; each of
N simulated requests draws its proposals from q (or proposes a fixed token, one-hot q) and is
verified at once. At every position, among the requests that reached it, the emitted token must
follow p: total-variation distance < 0.01 and a chi-square test at a fixed seed, with at least
2·10⁵ samples per position. A sampler that accepts every proposal must fail the same test.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.model.layers.sampler import filter_logits
from kvflow.spec_decode.rejection_sampler import Verification, rejection_sample

VOCAB = 24
MIN_SAMPLES = 200_000


def _probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    rows = logits.shape[0]
    filtered = filter_logits(logits / temperature, torch.full((rows,), top_k), torch.full((rows,), top_p),
                             torch.full((rows,), min_p))
    return filtered.softmax(dim=-1)


def _pair(k: int, seed: int, favourite: bool = False, **filters) -> tuple[torch.Tensor, torch.Tensor]:
    """(p [k+1, V], q [k, V]): the draft's distribution mixes the target's with 20% of another,
    so they overlap (acceptance ~0.9) yet differ by a total variation the always-accept sampler
    shows. `favourite`: the target puts most of its mass on one token (a lookup proposer's case)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(k + 1, VOCAB, generator=gen) * 1.5
    if favourite:
        target[torch.arange(k + 1), torch.randint(VOCAB, (k + 1,), generator=gen)] += 5.0
    other = torch.randn(k, VOCAB, generator=gen) * 1.5
    draft = (0.8 * target[:k].softmax(-1) + 0.2 * other.softmax(-1)).log()
    return _probs(target, **filters), _probs(draft, **filters)


def _simulate(sampler, p, q, one_hot: bool, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Emitted tokens [n, k+1] (−1 past the end) of n requests verifying the same proposals' law."""
    k = q.shape[0]
    gen = torch.Generator().manual_seed(seed)
    if one_hot:
        # A lookup proposer: always the draft's favourite token, with q = one-hot.
        drafts = q.argmax(dim=-1)[None, :].expand(n, k)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(k)], dim=1)
        draft_probs = q[None].expand(n, k, VOCAB)
    result = sampler(
        target_probs=p[None].expand(n, k + 1, VOCAB), draft_token_ids=drafts,
        num_drafts=torch.full((n,), k), draft_probs=draft_probs, greedy=torch.zeros(n, dtype=torch.bool),
        uniforms=torch.rand(n, k, generator=gen), noise=torch.empty(n, VOCAB).exponential_(generator=gen),
    )
    emitted = torch.full((n, k + 1), -1)
    positions = torch.arange(k + 1)[None, :]
    emitted = torch.where(positions < result.num_accepted[:, None], torch.cat([drafts, drafts[:, :1]], 1), emitted)
    emitted[torch.arange(n), result.num_accepted] = result.final_token
    return emitted, result.num_accepted


def _chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    support = expected_probs > 0
    if (counts[~support] > 0).any():
        return 0.0  # a token the target never emits
    observed, expected = counts[support].double(), expected_probs[support].double() * counts.sum()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = support.sum().double() - 1
    return float(torch.special.gammaincc(dof / 2, statistic / 2))  # the chi-square survival function


def _matches_target(sampler, p, q, one_hot: bool, seed: int = 1) -> bool:
    """Every position: ≥ MIN_SAMPLES emitted tokens, TV < 0.01 and chi-square p-value > 1e-3."""
    k = q.shape[0]
    # Enough requests that the last position is still reached MIN_SAMPLES times.
    reach = torch.ones(())
    for i in range(k):
        reach = reach * (p[i][q[i].argmax()] if one_hot else torch.minimum(p[i], q[i]).sum())
    n = int(MIN_SAMPLES / float(reach) * 1.05) + 1
    emitted, _ = _simulate(sampler, p, q, one_hot, n, seed)
    for position in range(k + 1):
        tokens = emitted[:, position]
        tokens = tokens[tokens >= 0]
        assert tokens.numel() >= MIN_SAMPLES
        counts = torch.bincount(tokens, minlength=VOCAB)
        tv = 0.5 * (counts / counts.sum() - p[position]).abs().sum()
        if tv >= 0.01 or _chi_square_p_value(counts, p[position]) <= 1e-3:
            return False
    return True


def always_accept(target_probs, draft_token_ids, num_drafts, draft_probs, greedy, uniforms, noise) -> Verification:
    """A wrong sampler: keeps every proposal, then a bonus token from p."""
    rows = torch.arange(len(num_drafts))
    bonus = (target_probs[rows, num_drafts] / noise).argmax(dim=-1)
    return Verification(num_drafts.clone(), bonus)


FILTERS = {
    "temperature 1": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "top-k, top-p, T 0.8": dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.0),
    "min-p, T 1.3": dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.05),
}


@pytest.mark.parametrize("filters", list(FILTERS), ids=list(FILTERS))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_probabilities_keep_the_target_distribution(k, filters):
    p, q = _pair(k, seed=10 + k, **FILTERS[filters])
    assert _matches_target(rejection_sample, p, q, one_hot=False)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_one_hot_proposals_keep_the_target_distribution(k):
    # A lookup proposer pays when the target has a clear favourite, and it proposes that token.
    p, q = _pair(k, seed=20 + k, favourite=True, **FILTERS["top-k, top-p, T 0.8"])
    assert _matches_target(rejection_sample, p, q, one_hot=True)


@pytest.mark.parametrize("one_hot", [False, True])
def test_always_accepting_fails_the_same_test(one_hot):
    p, q = _pair(3, seed=23, favourite=one_hot, **FILTERS["temperature 1"])
    assert not _matches_target(always_accept, p, q, one_hot=one_hot)


def test_acceptance_rate_is_one_minus_the_total_variation():
    # The expected number of accepted proposals at position 1 is Σ min(p, q) (Leviathan et al.).
    p, q = _pair(1, seed=5, **FILTERS["temperature 1"])
    _, accepted = _simulate(rejection_sample, p, q, one_hot=False, n=200_000, seed=3)
    assert abs(accepted.float().mean() - torch.minimum(p[0], q[0]).sum()) < 0.005


def test_greedy_rows_accept_exactly_the_matching_prefix():
    p = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3], [0.2, 0.3, 0.5]])[None].expand(2, 3, 3)
    drafts = torch.tensor([[1, 2], [1, 0]])  # row 0 diverges at position 2, row 1 matches both
    result = rejection_sample(p, drafts, torch.tensor([2, 2]), None, torch.tensor([True, True]),
                              torch.zeros(2, 2), torch.ones(2, 3))
    assert result.num_accepted.tolist() == [1, 2]
    assert result.final_token.tolist() == [0, 2]  # argmax where it diverged; the bonus argmax


def test_rows_without_proposals_sample_from_p_alone():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.3, 0.3, 0.4]]])
    result = rejection_sample(p, torch.tensor([[2]]), torch.tensor([0]), None, torch.tensor([False]),
                              torch.zeros(1, 1), torch.ones(1, 3))
    assert result.num_accepted.tolist() == [0] and result.final_token.tolist() == [1]


def test_verify_greedy_agrees_with_the_greedy_rows_of_rejection_sample():
    from kvflow.spec_decode.rejection_sampler import verify_greedy

    gen = torch.Generator().manual_seed(2)
    p = torch.rand(50, 4, 6, generator=gen).softmax(-1)
    drafts = torch.where(torch.rand(50, 3, generator=gen) < 0.6, p[:, :3].argmax(-1), torch.randint(6, (50, 3), generator=gen))
    num_drafts = torch.randint(0, 4, (50,), generator=gen)
    # Row r's bonus position is num_drafts[r]: rows past it are padding, as pad_rows makes them.
    full = rejection_sample(p, drafts, num_drafts, None, torch.ones(50, dtype=torch.bool), torch.zeros(50, 3),
                            torch.ones(50, 6))
    fast = verify_greedy(p.argmax(-1), drafts, num_drafts)
    assert torch.equal(full.num_accepted, fast.num_accepted) and torch.equal(full.final_token, fast.final_token)
    assert 0 < int((fast.num_accepted > 0).sum()) < 50
