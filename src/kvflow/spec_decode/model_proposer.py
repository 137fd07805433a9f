"""Proposals from a model run autoregressively: a small draft model, or the target's own first
layers (self-speculation, `layer_skip`).

Per step, for every request asked for k proposals:
1. catch up: one forward pass over the tokens the drafter has not seen yet, ending with the
   request's last token, gives the distribution q_1 of the first proposal;
2. k − 1 more passes, each feeding the proposal just drawn, give q_2..q_k.
All requests go through each pass together as one flat batch. A greedy request proposes the
argmax; any other draws from q after its temperature, top-k, top-p and min-p, with its own
generator if seeded, and q is kept for the rejection sampler.

A draft model keeps its own paged KV (same block ids as the target, separate tensors) and
remembers how far it is valid: everything up to its last proposing step, plus the proposals it
fed that the target then accepted. It trusts nothing it did not compute itself in the request's
current blocks, so a prefix hit, a copy-on-write or a swap-in only costs it a longer catch-up.
The layer-skip drafter shares the target's KV for its layers: the target's verification wrote
exactly what the drafter would have (same weights, same inputs), so it only ever feeds the last
token, and the slots its proposals write are overwritten by the next verification.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.proposer import DraftRequest, Proposals

# A drafter's rows' logits, their requests' params → q per row (DraftModelRunner.probs).
ProbsFn = Callable[[torch.Tensor, list[SamplingParams]], torch.Tensor]


@dataclass(frozen=True)
class DraftSpan:
    token_ids: list[int]  # fed at positions start_pos, start_pos + 1, ...
    start_pos: int
    block_ids: tuple[list[int], ...]  # the target's block table per KV group


class DraftModelRunner(Protocol):
    """What the worker lends the drafter: a forward pass over its KV, and the sampling filters."""

    def forward(self, spans: list[DraftSpan]) -> torch.Tensor:
        """Logits [len(spans), vocab] after each span's last token; writes the spans' KV."""

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Each row's distribution after its request's temperature, top-k, top-p and min-p."""


class ModelProposer:
    writes_kv = True
    reads_target_states = False  # a model of its own reads tokens only

    def __init__(self, runner: DraftModelRunner, generator: torch.Generator, shares_target_kv: bool) -> None:
        self.runner = runner
        self.generator = generator  # for requests without a seed
        self.shares_target_kv = shares_target_kv
        # request → (tokens it knew when it last proposed, the proposals it fed then)
        self._seen: dict[str, tuple[int, list[int]]] = {}

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._seen.pop(request_id, None)

    def propose(self, requests: list[DraftRequest]) -> Proposals:
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        spans = [self._catch_up(r) for r in requests]
        while active:
            logits = self.runner.forward(spans)
            drawn = draw_proposals(logits, [requests[i] for i in active], self.runner.probs, self.generator)
            for i, (token, q) in zip(active, drawn):
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if len(tokens[i]) < requests[i].num_tokens]
            spans = [DraftSpan([tokens[i][-1]], len(requests[i].token_ids) + len(tokens[i]) - 1, requests[i].block_ids)
                     for i in active]
        for r, proposed in zip(requests, tokens):
            self._seen[r.request_id] = (len(r.token_ids), proposed[:-1])  # the last one is never fed
        return Proposals({r.request_id: t for r, t in zip(requests, tokens)},
                         {r.request_id: torch.stack(q) for r, q in zip(requests, probs) if q})

    def _catch_up(self, request: DraftRequest) -> DraftSpan:
        """The span from the first position the drafter has no valid KV for to the last token."""
        known = len(request.token_ids)
        if self.shares_target_kv:
            start = known - 1  # the target computed everything before the last token
        else:
            seen, fed = self._seen.get(request.request_id, (0, []))
            accepted = 0
            while accepted < len(fed) and seen + accepted < known and request.token_ids[seen + accepted] == fed[accepted]:
                accepted += 1
            start = min(seen + accepted, known - 1)
        return DraftSpan(request.token_ids[start:], start, request.block_ids)


def draw_proposals(logits: torch.Tensor, requests: list[DraftRequest], probs: ProbsFn,
                   generator: torch.Generator) -> list[tuple[int, torch.Tensor | None]]:
    """A proposal per row: the argmax for greedy requests, else a draw from q = `probs(logits,
    params)` (returned with it), with the request's own generator if seeded, else `generator`."""
    greedy = [r.sampling_params.greedy for r in requests]
    tokens = logits.argmax(dim=-1)
    q = None
    if not all(greedy):
        q = probs(logits, [r.sampling_params for r in requests])
        noise = torch.empty_like(q).exponential_(generator=generator)
        for row, r in enumerate(requests):
            if r.generator is not None and not greedy[row]:
                noise[row].exponential_(generator=r.generator)
        tokens = torch.where(torch.tensor(greedy, device=q.device), tokens, (q / noise).argmax(dim=-1))
    ids = tokens.tolist()
    return [(ids[row], None if greedy[row] else q[row]) for row in range(len(requests))]
