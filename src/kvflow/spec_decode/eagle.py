"""Proposals from an EAGLE head (kvflow.model.models.eagle), which drafts from the target's hidden
states instead of re-reading the tokens.

Per step, over every chunk the target ran (prompt chunks too, and requests not asked for
proposals this step: a feature the head does not consume in its step is lost for good):
1. catch up: one pass over the chunk's rows whose inputs the target kept, each the pair (the
   target's feature at p, the token at p + 1); the pair at a sampling chunk's last kept row
   gives q_1 of the request's first proposal;
2. for the requests asked for k proposals, k − 1 more passes, each the pair (the head's own
   feature from its previous pass, the proposal just drawn).
Greedy requests propose the argmax; others draw from q after their temperature, top-k, top-p and
min-p and hand q to the rejection sampler, as the draft model does (`draw_proposals`).

Validity of the head's KV needs no bookkeeping: position p is written by the catch-up of the step
whose target rows hold p, from the target's feature, and every step's catch-up starts at the
step's first row, the first position the target did not verify before. The head's own passes
write past the last verified token, where the next catch-up writes again before anyone reads;
after a rejection the stale positions are exactly those.

What the head never sees: positions whose target KV came without a forward pass here (a prefix
cache hit, a KV-connector load) and blocks the runner copied or swapped (it moves the target's
KV only). The head attends there to whatever its KV holds (in a block shared through the prefix
cache, what the request that cached it wrote). Verification stays exact whatever the head
proposes; only acceptance can suffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.model_proposer import DraftSpan, draw_proposals
from kvflow.spec_decode.proposer import DraftRequest, FeatureSpan, Proposals, TargetStates


class FeatureDraftRunner(Protocol):
    """What the worker lends the head: forward passes over its KV (worker/draft_runner.py)."""

    def forward_features(self, spans: list[DraftSpan], features: torch.Tensor,
                         sampled: list[bool]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor: ...


class EagleProposer:
    writes_kv = True
    reads_target_states = True

    def __init__(self, runner: FeatureDraftRunner, combine: Callable[[torch.Tensor], torch.Tensor],
                 generator: torch.Generator, layer_states: Callable[[], torch.Tensor] | None = None) -> None:
        """`combine`: a target row's states → the head's feature (EAGLE-3's fc); `layer_states`:
        where EAGLE-3 reads the step's intermediate states (None: the final hidden states)."""
        self.runner = runner
        self.combine = combine
        self.generator = generator  # for requests without a seed
        self.layer_states = layer_states

    def drop(self, request_ids: Iterable[str]) -> None:
        """Nothing is kept per request (see the module's doc)."""

    def propose(self, requests: list[DraftRequest], target: TargetStates) -> Proposals:
        """Catch up on every span of the step, then draft for `requests` (those asked)."""
        asking = {r.request_id: r for r in requests}
        spans = [s for s in target.spans if s.next_tokens]
        states = target.hidden if self.layer_states is None else self.layer_states()
        if not spans:
            return Proposals({})
        sampled = [s.request_id in asking for s in spans]
        logits, fed = self.runner.forward_features(
            [DraftSpan(s.next_tokens, s.start_pos, s.block_ids) for s in spans], self._features(spans, states), sampled)
        return self._draft([asking[s.request_id] for s, asks in zip(spans, sampled) if asks], logits, fed)

    def _features(self, spans: list[FeatureSpan], states: torch.Tensor) -> torch.Tensor:
        rows = [row for s in spans for row in range(s.first_row, s.first_row + len(s.next_tokens))]
        return self.combine(states[torch.tensor(rows, device=states.device)])

    def _draft(self, requests: list[DraftRequest], logits: torch.Tensor, fed: torch.Tensor) -> Proposals:
        """Draw from the catch-up's `logits`, then feed the head its own features `fed` and the
        drawn tokens until each request has its proposals."""
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in requests}
        active = requests
        while active:
            for r, (token, q) in zip(active, draw_proposals(logits, active, self.runner.probs, self.generator)):
                tokens[r.request_id].append(token)
                if q is not None:
                    probs[r.request_id].append(q)
            going = [i for i, r in enumerate(active) if len(tokens[r.request_id]) < r.num_tokens]
            active = [active[i] for i in going]
            if active:
                # Proposal m is fed at position len(known) − 2 + m: the pair after the catch-up's last.
                spans = [DraftSpan([tokens[r.request_id][-1]], len(r.token_ids) - 2 + len(tokens[r.request_id]),
                                   r.block_ids) for r in active]
                logits, fed = self.runner.forward_features(spans, fed[going], [True] * len(active))
        return Proposals(tokens, {rid: torch.stack(q) for rid, q in probs.items() if q})
