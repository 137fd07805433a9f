"""Prompt lookup (n-gram) proposals: the text a model writes often repeats text it was given (a
summary quotes its source, an edit copies most of the file), so the tokens that followed the last
occurrence of the current suffix are a cheap guess at what comes next.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens are compared with
every earlier window of n tokens at once (one vectorised comparison over the context, no Python loop
over tokens); the most recent match of the longest n that is followed by k tokens wins (else the
match followed by the most) and the tokens after it are proposed. Nothing matched: no proposal, and
the request decodes one token as usual.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvflow.spec_decode.proposer import DraftRequest, Proposals


class NgramProposer:
    writes_kv = False  # proposals are looked up, not computed
    reads_target_states = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, requests: list[DraftRequest]) -> Proposals:
        return Proposals({r.request_id: self.lookup(np.asarray(r.token_ids), r.num_tokens) for r in requests})

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the longest suffix."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so each has a successor to propose.
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                # The most recent match that has k tokens after it; else the one with the most.
                full = hits[hits + n + k <= length]
                start = int(full[-1] if full.size else hits[0]) + n
                return tokens[start:start + k].tolist()
        return []

    def drop(self, request_ids) -> None:
        pass  # keeps nothing per request
