"""The worker's half of speculative decoding: verify the proposals a step carries, then ask the
proposer for the next step's.

Verification: a chunk with k proposals has k + 1 logit rows (after its last known token and after
each proposal). Each row gets the request's full sampling treatment as if decoded one token at a
time: its penalties count the proposals before it, its min_tokens ban counts them too. The
rejection sampler then compares these target distributions p with the proposals' q; its random
numbers come from the request's own generator when seeded, so seeded requests reproduce.

Proposing: a proposer that drafts from the target's hidden states (EAGLE) also gets the step's
rows, every chunk's, with the token that followed each row the target kept (`feature_span`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from kvflow.core.runner_output import ModelRunnerOutput, PositionLogprobs
from kvflow.core.sched_output import ScheduledChunk
from kvflow.model.layers.sampler import Sampler, SamplingBatch, first_argmax, gather_logprobs
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.proposer import DraftRequest, FeatureSpan, Proposer, TargetStates
from kvflow.spec_decode.rejection_sampler import pad_rows, rejection_sample, verify_greedy

GeneratorOf = Callable[[ScheduledChunk], torch.Generator | None]


class VerifyRow(NamedTuple):
    """One logit row of a chunk, seen as the runner's sampling-batch builder sees a chunk: the
    request's outputs so far include the proposals before this row."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]


BatchBuilder = Callable[[list[ScheduledChunk | VerifyRow]], SamplingBatch]


class StepRows(NamedTuple):
    """The step's flat batch as the target ran it: its chunks in row order, and the hidden states
    of their rows (the model's output, after the final norm)."""

    chunks: list[ScheduledChunk]
    hidden: torch.Tensor


class Speculator:
    def __init__(self, proposer: Proposer, sampler: Sampler, device: torch.device,
                 reads_layer_states: bool = False) -> None:
        """`reads_layer_states`: the proposer reads the target's intermediate states, which only a
        forward pass through the modules keeps (EAGLE-3): the runner's fast steps are not taken."""
        self.proposer = proposer
        self.sampler = sampler
        self.device = device
        self.reads_target_states = proposer.reads_target_states
        self.reads_layer_states = reads_layer_states
        self._draft_probs: dict[str, torch.Tensor] = {}  # q of each request's pending proposals

    def drop(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        for request_id in request_ids:
            self._draft_probs.pop(request_id, None)
        self.proposer.drop(request_ids)

    # -- verification ----------------------------------------------------------------------
    def verify(self, chunks: list[ScheduledChunk], logits: torch.Tensor, sampling_batch: BatchBuilder,
               generator_of: GeneratorOf, out: ModelRunnerOutput) -> None:
        """`logits`: the k + 1 rows of each sampling chunk, in order."""
        counts = [c.num_spec_tokens + 1 for c in chunks]
        rows = [VerifyRow(c.request_id, c.sampling_params, c.prompt_token_ids,
                          [*c.output_token_ids, *c.spec_token_ids[:j]] if j else c.output_token_ids, c.eos_token_ids)
                for c in chunks for j in range(c.num_spec_tokens + 1)]
        batch = sampling_batch(rows)
        adjusted, raw_logprobs = self.sampler.adjust(logits, batch)
        width = max(counts)
        drafts = torch.tensor([c.spec_token_ids + [0] * (width - n) for c, n in zip(chunks, counts)], device=self.device)
        num_drafts = torch.tensor([c.num_spec_tokens for c in chunks], device=self.device)
        if batch.all_greedy:  # argmax per row is all there is to compare
            for chunk in chunks:
                self._draft_probs.pop(chunk.request_id, None)
            result = verify_greedy(pad_rows(first_argmax(adjusted), counts, width), drafts, num_drafts)
        else:
            target = pad_rows(self.sampler.probs(adjusted, batch), counts, width)
            vocab = target.shape[-1]
            uniforms, noise = self._randomness(chunks, generator_of, width - 1, vocab)
            result = rejection_sample(
                target, drafts, num_drafts, self._stacked_draft_probs(chunks, width - 1, vocab),
                torch.tensor([c.sampling_params.greedy for c in chunks], device=self.device), uniforms, noise)
        accepted, final = result.num_accepted.tolist(), result.final_token.tolist()
        offsets = [0, *itertools.accumulate(counts)][:-1]
        for i, chunk in enumerate(chunks):
            out.sampled[chunk.request_id] = [*chunk.spec_token_ids[:accepted[i]], final[i]]
        if raw_logprobs is not None:
            self._collect_logprobs(chunks, offsets, raw_logprobs, batch.num_logprobs, out)

    def _randomness(self, chunks: list[ScheduledChunk], generator_of: GeneratorOf, k: int,
                    vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Acceptance uniforms [R, k] and Exp(1) noise [R, vocab] for the final draw, a seeded
        request's drawn from its own generator (its proposals' uniforms, then its noise)."""
        uniforms = torch.rand(len(chunks), k, generator=self.sampler.generator, device=self.device)
        noise = torch.empty(len(chunks), vocab, device=self.device).exponential_(generator=self.sampler.generator)
        for row, chunk in enumerate(chunks):
            own = generator_of(chunk)
            if own is not None:
                n = chunk.num_spec_tokens
                uniforms[row, :n] = torch.rand(n, generator=own, device=self.device)
                noise[row].exponential_(generator=own)
        return uniforms, noise

    def _stacked_draft_probs(self, chunks: list[ScheduledChunk], k: int, vocab: int) -> torch.Tensor | None:
        """q [R, k, vocab] of the proposals being verified; None when every proposal is certain."""
        pending = [self._draft_probs.pop(c.request_id, None) for c in chunks]
        if all(q is None for q in pending):
            return None
        stacked = torch.zeros(len(chunks), k, vocab, device=self.device)
        for row, (chunk, q) in enumerate(zip(chunks, pending)):
            n = chunk.num_spec_tokens
            if q is not None and n:
                stacked[row, :n] = q[:n]  # the scheduler may verify fewer than were proposed
            elif n:  # certain proposals (this request is greedy): one-hot
                stacked[row, torch.arange(n), torch.tensor(chunk.spec_token_ids)] = 1.0
        return stacked

    @staticmethod
    def _collect_logprobs(chunks, offsets, raw_logprobs, num_top, out: ModelRunnerOutput) -> None:
        rows, tokens = [], []
        for chunk, offset in zip(chunks, offsets):
            if chunk.sampling_params.logprobs is not None:
                produced = out.sampled[chunk.request_id]
                rows.extend(range(offset, offset + len(produced)))
                tokens.extend(produced)
        if not rows:
            return
        index = torch.tensor(rows, device=raw_logprobs.device)
        values, ids, ranks = gather_logprobs(raw_logprobs[index], torch.tensor(tokens, device=raw_logprobs.device), num_top)
        values, ids, ranks = values.tolist(), ids.tolist(), ranks.tolist()
        j = 0
        for chunk in chunks:
            n = chunk.sampling_params.logprobs
            if n is None:
                continue
            produced = len(out.sampled[chunk.request_id])
            out.logprobs[chunk.request_id] = [PositionLogprobs(ids[i][:n + 1], values[i][:n + 1], ranks[i])
                                              for i in range(j, j + produced)]
            j += produced

    # -- proposing -------------------------------------------------------------------------
    def propose(self, chunks: list[ScheduledChunk], generator_of: GeneratorOf, out: ModelRunnerOutput,
                step: StepRows | None = None) -> None:
        """The next step's proposals of the chunks that asked for some (a request's grammar, if it
        has one, cuts them on the engine's side before they are verified). `step`: the whole
        step's rows, for a proposer that `reads_target_states` (which then runs even when no
        chunk asks, to read the rows)."""
        requests = [
            DraftRequest(c.request_id, [*c.prompt_token_ids, *c.output_token_ids, *out.sampled[c.request_id]],
                         c.num_lookahead_tokens, c.block_ids, c.sampling_params, generator_of(c))
            for c in chunks if c.num_lookahead_tokens and c.request_id in out.sampled
        ]
        if self.reads_target_states:
            spans, row = [], 0
            for chunk in step.chunks:
                spans.append(feature_span(chunk, row, out.sampled.get(chunk.request_id)))
                row += chunk.num_tokens
            proposals = self.proposer.propose(requests, TargetStates(spans, step.hidden))
        elif requests:
            proposals = self.proposer.propose(requests)
        else:
            return
        self._draft_probs.update(proposals.probs)
        out.draft_token_ids = {rid: t for rid, t in proposals.token_ids.items() if t}


def feature_span(chunk: ScheduledChunk, first_row: int, sampled: list[int] | None) -> FeatureSpan:
    """The chunk's rows whose inputs the target kept, each with the token that followed it: the
    chunk's own next tokens, then what it sampled (the accepted proposals, which were the inputs
    of the rows after them, and the token after the last) or, for a chunk that does not sample,
    the request's next known token."""
    verified = chunk.num_tokens - chunk.num_spec_tokens  # rows before the proposals
    following = chunk.token_ids[1:verified]
    if chunk.sample:
        return FeatureSpan(chunk.request_id, chunk.start_pos, first_row, following + (sampled or []), chunk.block_ids)
    end = chunk.start_pos + chunk.num_tokens
    known = chunk.prompt_token_ids if end < len(chunk.prompt_token_ids) else chunk.prompt_token_ids + chunk.output_token_ids
    return FeatureSpan(chunk.request_id, chunk.start_pos, first_row, following + known[end:end + 1], chunk.block_ids)
