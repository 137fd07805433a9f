"""What the worker lends a model drafter (`spec_decode.model_proposer`): forward passes over a
draft model's paged KV, built by the target runner's own flat-batch code, and the sampling filters.

For a draft model, and an EAGLE head (`HeadRunner`), the KV tensors are its own, indexed by the
block ids of one of the target's KV groups (`target_groups`: the target group whose table each
draft group follows). For layer-skip self-speculation the model is the target and the KV tensors
are the target's first layers': a decoder runs one layer per KV tensor it is given, then its
final norm, and the LM head follows.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.core.sched_output import ScheduledChunk
from kvflow.model.layers.sampler import filter_logits
from kvflow.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from kvflow.spec_decode.model_proposer import DraftSpan
from kvflow.worker.model_runner import FlatBatch, ModelRunner


class DraftRunner:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], target_runner: ModelRunner,
                 target_groups: tuple[int, ...] | None = None) -> None:
        """`target_groups`: for each of the model's KV groups, the target group whose block table
        it uses; None when the model's groups are the target's (layer skip)."""
        self.model = model
        self.kv_caches = kv_caches
        self.target_groups = target_groups
        self.target_runner = target_runner  # for its flat-batch builder (positions, slots, metadata)
        self._plain = SamplingParams(max_tokens=None)  # drafting rows want no prompt logprobs

    @torch.inference_mode()
    def forward(self, spans: list[DraftSpan]) -> torch.Tensor:
        batch = self._batch(spans, [True] * len(spans))
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        return self.model.compute_logits(hidden[batch.sample_rows])

    def _batch(self, spans: list[DraftSpan], sampled: list[bool]) -> FlatBatch:
        """The spans as one flat batch; logit rows at the last row of each span `sampled` says."""
        return self.target_runner.prepare([
            ScheduledChunk("", s.token_ids, s.start_pos, self._tables(s.block_ids), sample, self._plain, [], [],
                           frozenset()) for s, sample in zip(spans, sampled)])

    def _tables(self, target_tables: tuple[list[int], ...]) -> tuple[list[int], ...]:
        return target_tables if self.target_groups is None else tuple(target_tables[g] for g in self.target_groups)

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        def column(name: str, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=logits.device)

        temperature = column("temperature").clamp(min=GREEDY_TEMPERATURE)  # greedy rows' q is never read
        filtered = filter_logits(logits.float() / temperature[:, None], column("top_k", torch.long), column("top_p"),
                                 column("min_p"), any(p.top_k > 0 or p.top_p < 1 for p in params))
        return filtered.softmax(dim=-1)


class HeadRunner(DraftRunner):
    """Forward passes of an EAGLE head (kvflow.model.models.eagle) over its own KV: each row takes
    a feature beside its token."""

    @torch.inference_mode()
    def forward_features(self, spans: list[DraftSpan], features: torch.Tensor,
                         sampled: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the head's next feature) at the last row of each span `sampled` says; `features`:
        a row per token of the spans, in order. Writes every row's KV."""
        batch = self._batch(spans, sampled)
        hidden, fed = self.model(batch.input_ids, batch.positions, features, self.kv_caches, batch.attn)
        return self.model.compute_logits(hidden[batch.sample_rows]), fed[batch.sample_rows]
