"""Counters of speculative decoding, named as vLLM's spec-decode metrics: verifications (drafts),
proposed and accepted tokens, acceptance per position, and the time spent proposing vs in the
target model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int  # k: positions a proposal can have
    num_drafts: int = 0  # verifications: one request's proposals checked in one step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    target_seconds: float = 0.0  # target forward passes and sampling, in steps with speculation on
    proposer_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.drafted_per_position = self.drafted_per_position or [0] * self.num_spec_tokens
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_spec_tokens

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    def snapshot(self) -> SpecDecodingStats:
        return dataclasses.replace(self, drafted_per_position=list(self.drafted_per_position),
                                   accepted_per_position=list(self.accepted_per_position))

    @property
    def acceptance_rate(self) -> float:
        """α: the fraction of proposed tokens accepted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields: the accepted proposals and the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def per_position_rates(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def describe(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.per_position_rates())
        return (f"speculation: mean acceptance length {self.mean_acceptance_length:.2f}, "
                f"accepted {self.num_accepted_tokens} of {self.num_draft_tokens} proposed ({self.acceptance_rate:.1%}), "
                f"per position {rates}; proposer {self.proposer_seconds:.1f} s vs target {self.target_seconds:.1f} s")
