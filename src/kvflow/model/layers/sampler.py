"""From logits to tokens, one row per request that needs a token this step.

Order: penalties, the grammar's token mask (structured output) and min_tokens masking on the raw
logits; logprobs are reported from the raw logits (what the model said, as vLLM reports them);
then temperature, min-p, top-k, top-p, and a draw. A draw is argmax(probs / E) with E ~ Exp(1)
i.i.d. — the same distribution as sampling from probs — so a request with a seed owns a generator
and draws exactly `vocab` numbers a step: its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvflow.model.layers import cpu_ops
from kvflow.sampling_params import GREEDY_TEMPERATURE


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [R] float; 0 = greedy
    top_k: torch.Tensor  # [R] int; 0 = off
    top_p: torch.Tensor  # [R]
    min_p: torch.Tensor  # [R]
    repetition_penalty: torch.Tensor  # [R]
    frequency_penalty: torch.Tensor  # [R]
    presence_penalty: torch.Tensor  # [R]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    banned_token_ids: list[list[int]]  # eos/stop ids while min_tokens is not reached
    generators: list[torch.Generator | None]  # None: the engine's shared generator
    num_logprobs: int  # the most top logprobs any row asked for; -1 = none
    # Known on the host when the batch is built, so skipping unused work needs no device→host
    # sync. The defaults are always correct, only slower.
    all_greedy: bool = False
    any_penalties: bool = True
    any_top_k_or_p: bool = True
    # Structured output: bit t of grammar_bitmask[i] set = token t allowed in row grammar_rows[i]
    # (int32 words, on the logits' device). None when no row has a grammar: nothing is paid.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None
    # OpenAI's logit_bias, per row ({} for none): added to the logits after the penalties.
    logit_bias: list[dict[int, float]] | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None = None  # [R, 1 + N]: the sampled token's, then the top N
    logprob_token_ids: torch.Tensor | None = None  # [R, 1 + N]
    sampled_ranks: torch.Tensor | None = None  # [R]: 1 = the most likely token


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Logits in any float dtype: they are widened to float32 only where something adjusts them."""
        if (batch.all_greedy and batch.num_logprobs < 0 and not batch.any_penalties and batch.grammar_bitmask is None
                and not any(batch.banned_token_ids) and not any(batch.logit_bias or ())):
            # Nothing to adjust: the argmax of the logits as they are (widening keeps the order),
            # without a float32 copy of them (25 MB for 128 rows of a 49,152-token vocabulary,
            # ~5 ms here: its pages are new at every step).
            return SamplerOutput(token_ids=first_argmax(logits))
        logits, raw_logprobs = self.adjust(logits, batch)
        tokens = self._sample(logits, batch)
        out = SamplerOutput(token_ids=tokens)
        if raw_logprobs is not None:
            out.logprobs, out.logprob_token_ids, out.sampled_ranks = gather_logprobs(raw_logprobs, tokens, batch.num_logprobs)
        return out

    @staticmethod
    def adjust(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Penalties, the grammar's mask and min_tokens bans applied; the raw logprobs, if any
        row wants logprobs."""
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if batch.num_logprobs >= 0 else None
        logits = apply_logit_bias(apply_penalties(logits, batch), batch.logit_bias)
        has_grammar = batch.grammar_bitmask is not None
        if has_grammar:
            logits = apply_grammar_bitmask(logits, batch.grammar_bitmask, batch.grammar_rows)
        # A grammar that only allows ending overrules min_tokens: a row never loses every token.
        return ban_tokens(logits, batch.banned_token_ids, never_empty=has_grammar), raw_logprobs

    @staticmethod
    def probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution each row samples from: temperature, min-p, top-k, top-p. Greedy rows
        keep temperature 1 (their argmax is what counts)."""
        greedy = batch.temperature < GREEDY_TEMPERATURE
        temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
        logits = filter_logits(logits / temperature[:, None], batch.top_k, batch.top_p, batch.min_p, batch.any_top_k_or_p)
        return logits.softmax(dim=-1)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_tokens = first_argmax(logits)
        if batch.all_greedy:
            return greedy_tokens
        greedy = batch.temperature < GREEDY_TEMPERATURE
        probs = self.probs(logits, batch)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in enumerate(batch.generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        sampled = first_argmax(probs / noise)
        return torch.where(greedy, greedy_tokens, sampled)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value (the first of equals), as argmax: torch's CPU argmax
    over a vocabulary-wide row is 2-3× slower than max's indices (4 ms of a 64-decode step), and
    the C++ kernel ~6× faster than those (batch-1 decode samples one row a token)."""
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.shape[1] > 0
            and x.stride(1) == 1 and _cpu_argmax_built()):
        return cpu_ops.first_argmax(x)
    return x.max(dim=-1).indices


@functools.cache
def _cpu_argmax_built() -> bool:
    return cpu_ops.load() is not None


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if not batch.any_penalties:
        return logits
    vocab = logits.shape[1]
    counts = _token_counts(batch.output_token_ids, vocab, logits.device)
    seen = (counts + _token_counts(batch.prompt_token_ids, vocab, logits.device)) > 0
    # Repetition penalty (CTRL): shrink the logit of any token already seen, toward less likely.
    rep = batch.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    # OpenAI's frequency and presence penalties count only generated tokens.
    logits = logits - batch.frequency_penalty[:, None] * counts
    return logits - batch.presence_penalty[:, None] * (counts > 0).float()


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float]] | None) -> torch.Tensor:
    """Each row's bias added to its own tokens' logits (in place), all rows in one scatter."""
    if not any(biases or ()):
        return logits
    rows = [row for row, bias in enumerate(biases) for _ in bias]
    tokens = [t for bias in biases for t in bias]
    values = [b for bias in biases for b in bias.values()]
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)
    return logits


def _token_counts(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab, device=device)
    row_ids, token_ids = _flat_index(rows, device)
    counts.index_put_((row_ids, token_ids), torch.ones(len(token_ids), device=device), accumulate=True)
    return counts


def ban_tokens(logits: torch.Tensor, banned: list[list[int]], never_empty: bool = False) -> torch.Tensor:
    if not any(banned):
        return logits
    before = logits.clone() if never_empty else None
    logits[_flat_index(banned, logits.device)] = float("-inf")
    if before is not None:
        emptied = torch.isneginf(logits).all(dim=-1, keepdim=True)
        logits = torch.where(emptied, before, logits)
    return logits


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """-inf at every token a row's grammar does not allow (in place). Token t is bit t % 32 of
    word t // 32, the layout llguidance and xgrammar fill; read as little-endian bytes, that is
    bit t % 8 of byte t // 8. Each byte looks up its 8 additive penalties (0 or -inf) in a
    256-entry table, and one index_add_ applies them (measured on a CPU: over 10x faster than
    unpacking the bits with shifts and a masked fill, and faster than xgrammar's C++ kernel)."""
    bits = (torch.arange(256, device=bitmask.device)[:, None] >> torch.arange(8, device=bitmask.device)) & 1
    penalty = torch.zeros(256, 8, device=bitmask.device).masked_fill_(bits == 0, float("-inf"))
    added = penalty[bitmask.view(torch.uint8).long()].flatten(1)[:, :logits.shape[1]]
    return logits.index_add_(0, rows, added)


def _flat_index(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of ragged per-row token lists, as two tensors: one host→device
    copy for the whole batch instead of one per row."""
    pairs = torch.tensor([(r, t) for r, ids in enumerate(rows) for t in ids], dtype=torch.long).reshape(-1, 2)
    pairs = pairs.to(device)
    return pairs[:, 0], pairs[:, 1]


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  any_top_k_or_p: bool = True) -> torch.Tensor:
    """Set to -inf every token outside min-p, then top-k, then top-p (nucleus). Rows whose
    filters are off pass through unchanged; the most likely token always survives.
    `any_top_k_or_p=False` (no row uses either) skips the sort."""
    probs = logits.softmax(dim=-1)
    top_prob = probs.max(dim=-1, keepdim=True).values
    logits = logits.masked_fill(probs < min_p[:, None] * top_prob, float("-inf"))
    if any_top_k_or_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, logits.shape[1])[:, None]
        drop = rank >= k
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)  # off means off, despite rounding
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, num_top: int) -> tuple[torch.Tensor, ...]:
    """For each row: the logprob of `tokens[row]` followed by the top `num_top` ([R, 1 + N]), the
    matching token ids ([R, 1 + N]), and the token's rank in the vocabulary ([R]; 1 = best)."""
    chosen = logprobs.gather(1, tokens[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return torch.cat([chosen, top_values], 1), torch.cat([tokens[:, None], top_ids], 1), ranks
