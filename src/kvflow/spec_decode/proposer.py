"""The proposer interface: after a step, guess the tokens that follow each request's last token.

The worker calls `propose` once per step for every request the scheduler asked proposals of, and
`drop` for requests that finished or lost their KV (preempted). A proposer that runs a model
(`writes_kv`) writes the KV of its proposals into slots the scheduler reserved for them. One that
drafts from the target's hidden states (`reads_target_states` true: EAGLE) is called as
`propose(requests, target)` with the step's rows (`TargetStates`) of every chunk, prompt chunks
too, even in a step where no request asks for proposals.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvflow.sampling_params import SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    request_id: str
    token_ids: list[int]  # every known token: prompt, outputs, and this step's
    num_tokens: int  # how many to propose
    block_ids: tuple[list[int], ...]  # its KV blocks per group, with slots reserved for the proposals
    sampling_params: SamplingParams
    generator: torch.Generator | None  # a seeded request's own; None: the proposer's


@dataclass
class Proposals:
    token_ids: dict[str, list[int]]
    # The distribution q each proposal was drawn from, after the request's temperature, top-k,
    # top-p and min-p ([num proposed, vocab]); absent: the proposals are certain (one-hot q), as
    # for a lookup or a greedy request.
    probs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class FeatureSpan:
    """One chunk of the step as a drafter that reads the target's states sees it: its rows
    `first_row`.. in the step's states, at positions `start_pos`.., and the token that followed
    each row. Only rows whose input the target kept count: after a verification, the rows past
    the accepted proposals are dropped (len(next_tokens) <= the chunk's rows)."""

    request_id: str
    start_pos: int
    first_row: int
    next_tokens: list[int]
    block_ids: tuple[list[int], ...]


@dataclass(frozen=True)
class TargetStates:
    spans: list[FeatureSpan]
    hidden: torch.Tensor  # the step's final hidden states, a row per token of the flat batch


class Proposer(Protocol):
    writes_kv: bool
    reads_target_states: bool  # propose(requests, TargetStates) with the step's rows (EAGLE)

    def propose(self, requests: list[DraftRequest], states: TargetStates | None = None) -> Proposals: ...

    def drop(self, request_ids: Iterable[str]) -> None: ...
