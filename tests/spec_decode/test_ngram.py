"""Prompt lookup: the longest suffix's most recent earlier occurrence, and what followed it."""

from __future__ import annotations

import numpy as np

from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.ngram import NgramProposer
from kvflow.spec_decode.proposer import DraftRequest


def _lookup(tokens, k=3, lo=1, hi=3):
    return NgramProposer(lo, hi).lookup(np.array(tokens), k)


def test_proposes_what_followed_the_suffix():
    assert _lookup([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    # "3" alone last occurred before 7; "2 3" occurred before 4.
    assert _lookup([2, 3, 4, 5, 3, 7, 8, 2, 3], k=2) == [4, 5]


def test_the_most_recent_occurrence_of_the_longest_suffix_wins():
    assert _lookup([1, 2, 5, 1, 2, 6, 1, 2], k=1, hi=2) == [6]


def test_proposals_stop_at_the_end_of_the_context():
    assert _lookup([7, 8, 9, 7, 8], k=5, hi=2) == [9, 7, 8]


def test_no_match_or_a_too_short_suffix_proposes_nothing():
    assert _lookup([1, 2, 3, 4], lo=1) == []
    assert _lookup([5, 6, 5], lo=2) == []  # "6 5" never occurred before
    assert _lookup([5], lo=1) == []


def test_propose_serves_each_request_its_own_count():
    proposer = NgramProposer(1, 2)
    params = SamplingParams()
    requests = [DraftRequest("a", [1, 2, 3, 1, 2], 2, [], params, None),
                DraftRequest("b", [4, 4, 4, 4], 3, [], params, None)]
    assert proposer.propose(requests).token_ids == {"a": [3, 1], "b": [4, 4]}
