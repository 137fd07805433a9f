"""The adaptive choice of k: it follows a request's acceptance and the measured costs, and turns
speculation off once the batch is compute-bound."""

from __future__ import annotations

import pytest

from kvflow.spec_decode.adaptive import AdaptiveSpeculation, StepTimeModel, best_k, expected_tokens
from kvflow.spec_decode.config import SpeculativeConfig


def _policy(**kw) -> AdaptiveSpeculation:
    return AdaptiveSpeculation(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, **kw}))


def _memory_bound_steps(policy: AdaptiveSpeculation, fixed: float = 0.030, per_token: float = 0.0005) -> None:
    for tokens in (1, 5, 64, 320, 2, 17) * 2:  # twice: a size's first step is not fitted
        policy.observe_step(tokens, fixed + per_token * tokens, 0, 0.0, True)


def test_expected_tokens_is_the_geometric_chain():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5


def test_best_k_grows_with_acceptance_and_shrinks_with_cost():
    assert best_k(0.9, 8, 0.02, 0.0) > best_k(0.5, 8, 0.02, 0.0) > 0
    assert best_k(0.9, 8, 0.02, 0.3) < best_k(0.9, 8, 0.02, 0.0)
    assert best_k(0.05, 8, 0.02, 0.0) == 0
    assert best_k(0.99, 8, 1.0, 0.0) == 0  # verifying a token costs as much as decoding it


def test_step_time_model_recovers_a_linear_cost():
    model = StepTimeModel()
    for tokens in (1, 8, 64, 3, 200, 16) * 2:
        model.observe(tokens, 0.02 + 0.001 * tokens)
    a, b = model.fit()
    assert a == pytest.approx(0.02, rel=1e-6) and b == pytest.approx(0.001, rel=1e-6)


def test_a_sizes_first_step_is_not_fitted():
    """The first step at a row count pays one-off costs (the CPU decode step lays out that count's
    kernel plans): a first verification of 9 rows taking 45 ms beside one-token steps of 3.2 ms made
    b a whole decode step a token, and speculation switched itself off for good at batch 1."""
    model = StepTimeModel(skip_first_of_each_size=True)
    model.observe(1, 0.0032)
    model.observe(9, 0.045)  # the first 9-row step: plans, layouts
    for _ in range(3):
        model.observe(1, 0.0032)
        model.observe(9, 0.0032 + 8 * 0.0004)
    a, b = model.fit()
    assert a == pytest.approx(0.0028, rel=1e-6) and b == pytest.approx(0.0004, rel=1e-6)


def test_speculation_pays_at_batch_one_and_switches_off_when_compute_bound():
    policy = _policy()
    _memory_bound_steps(policy)
    for _ in range(5):
        policy.observe("r", 4, 4)
    assert policy.num_lookahead_tokens("r", batch_size=1) == 4
    # At 512 requests a step is 0.03 + 0.256 s: a request's share is mostly its own token's compute.
    assert policy.num_lookahead_tokens("r", batch_size=512) == 0


def test_k_follows_each_requests_acceptance_and_recovers():
    policy = _policy()
    _memory_bound_steps(policy, per_token=0.01)  # verifying a token costs a quarter of a decode
    for _ in range(6):
        policy.observe("good", 4, 4)
        policy.observe("bad", 4, 0)
    assert policy.num_lookahead_tokens("good", 1) == 4
    assert policy.num_lookahead_tokens("bad", 1) == 0
    # Without verifications the estimate drifts back to the prior: the request tries again.
    tries = [policy.num_lookahead_tokens("bad", 1) for _ in range(60)]
    assert tries[-1] > 0


def test_a_slow_proposer_lowers_k():
    cheap, slow = _policy(), _policy()
    for policy, proposer_seconds in ((cheap, 0.0), (slow, 0.02)):
        _memory_bound_steps(policy)
        for _ in range(5):
            policy.observe("r", 4, 3)
        policy.observe_step(5, 0.0325, 4, proposer_seconds, True)
    assert slow.num_lookahead_tokens("r", 1) < cheap.num_lookahead_tokens("r", 1)


def test_fixed_k_and_the_batch_size_cutoff():
    policy = _policy(adaptive=False, disable_by_batch_size=8)
    policy.observe("r", 4, 0)
    assert policy.num_lookahead_tokens("r", 7) == 4
    assert policy.num_lookahead_tokens("r", 8) == 0


def test_stats_count_verifications_per_position():
    policy = _policy()
    policy.observe("a", 4, 2)
    policy.observe("b", 2, 2)
    stats = policy.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.per_position_rates() == [1.0, 1.0, 0.0, 0.0]
    assert stats.mean_acceptance_length == 3.0 and stats.acceptance_rate == pytest.approx(4 / 6)


def test_until_step_sizes_vary_every_other_step_speculates():
    policy = _policy()
    ks = []
    for _ in range(4):
        ks.append(policy.num_lookahead_tokens("r", 1))
        policy.observe_step(64, 0.05, 0, 0.0, True)  # always the same size: a and b stay unknown
    assert policy.step_time.fit() is None and ks == [0, 4, 0, 4]


def test_steps_with_prompt_tokens_do_not_enter_the_step_time_fit():
    policy = _policy()
    policy.observe_step(2000, 0.5, 0, 0.0, False)
    policy.observe_step(8, 0.030, 0, 0.0, False)
    assert policy.step_time.fit() is None
