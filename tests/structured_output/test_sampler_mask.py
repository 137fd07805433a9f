"""The sampler's half of structured output: the bitmask is unpacked exactly, only the rows with a
grammar are touched, and a grammar that can only end overrules min_tokens' ban on ending."""

from __future__ import annotations

import torch

from kvflow.model.layers.sampler import Sampler, SamplingBatch, apply_grammar_bitmask, ban_tokens


def naive_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    words = bitmask.tolist()
    return torch.tensor([[bool((row[t // 32] >> (t % 32)) & 1) for t in range(vocab)] for row in words])


def batch(rows: int, vocab: int, **fields) -> SamplingBatch:
    ones, zeros = torch.ones(rows), torch.zeros(rows)
    return SamplingBatch(
        temperature=ones.clone(), top_k=torch.zeros(rows, dtype=torch.long), top_p=ones.clone(), min_p=zeros.clone(),
        repetition_penalty=ones.clone(), frequency_penalty=zeros.clone(), presence_penalty=zeros.clone(),
        prompt_token_ids=[[1]] * rows, output_token_ids=[[]] * rows, banned_token_ids=[[]] * rows,
        generators=[torch.Generator().manual_seed(100 + r) for r in range(rows)], num_logprobs=-1, **fields)


def test_unpacking_matches_the_bit_layout_including_the_sign_bit():
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's high bits are padding
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    rows = torch.tensor([4, 0, 2])
    out = apply_grammar_bitmask(logits.clone(), bitmask, rows)
    want = logits.clone()
    want[rows] = want[rows].masked_fill(~naive_allowed(bitmask, vocab), float("-inf"))
    assert torch.equal(out, want)
    assert torch.equal(out[[1, 3]], logits[[1, 3]])  # rows without a grammar are untouched


def test_sampled_tokens_obey_the_mask_and_other_rows_do_not_notice():
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    allowed = [5, 17, 40, 63]
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    for t in allowed:
        bitmask[0, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)
    free = Sampler(torch.Generator().manual_seed(0))(logits.clone(), batch(3, vocab)).token_ids
    for seed in range(20):
        b = batch(3, vocab, grammar_bitmask=bitmask, grammar_rows=torch.tensor([1]))
        b.generators = [torch.Generator().manual_seed(100 + r) for r in range(3)]
        tokens = Sampler(torch.Generator().manual_seed(seed))(logits.clone(), b).token_ids
        assert tokens[1].item() in allowed
        assert tokens[0] == free[0] and tokens[2] == free[2]  # seeded rows draw the same as without it


def test_a_grammar_that_only_allows_the_end_beats_min_tokens():
    logits = torch.zeros(2, 8)
    logits[0, :7] = -float("inf")  # row 0's grammar allows only token 7, the end
    banned = [[7], [7]]  # min_tokens not reached: the end is banned
    out = ban_tokens(logits.clone(), banned, never_empty=True)
    assert out[0, 7] == 0  # row 0 would have nothing left: the ban is lifted there
    assert out[1, 7] == -float("inf") and torch.isfinite(out[1, 0])
    assert torch.isneginf(ban_tokens(logits.clone(), banned)[0]).all()  # without a grammar: as before
