"""What the scheduler asks about speculation: how many tokens to propose for a request, whether
proposals need KV slots of their own, and what it learns from each verification."""

from __future__ import annotations

from typing import Protocol


class SpeculationPolicy(Protocol):
    # A proposer that runs a model writes the KV of its proposals: the scheduler reserves their
    # slots with the step that precedes the proposing. Token-matching proposers write none.
    reserves_kv_slots: bool

    def num_lookahead_tokens(self, request_id: str, batch_size: int) -> int:
        """Tokens to propose for this request after the current step (0: do not speculate)."""

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """One verification of this request's proposals."""

    def forget(self, request_id: str) -> None:
        """The request finished."""
