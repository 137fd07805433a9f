"""The sampler on crafted logits, where the right answer is known exactly."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.model.layers import cpu_ops
from kvflow.model.layers.sampler import Sampler, SamplingBatch, apply_penalties, filter_logits, first_argmax
from kvflow.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _batch(rows: int, vocab: int, **overrides) -> SamplingBatch:
    fields = dict(
        temperature=torch.ones(rows), top_k=torch.zeros(rows, dtype=torch.long), top_p=torch.ones(rows),
        min_p=torch.zeros(rows), repetition_penalty=torch.ones(rows), frequency_penalty=torch.zeros(rows),
        presence_penalty=torch.zeros(rows), prompt_token_ids=[[] for _ in range(rows)],
        output_token_ids=[[] for _ in range(rows)], banned_token_ids=[[] for _ in range(rows)],
        generators=[None] * rows, num_logprobs=-1,
    )
    fields.update(overrides)
    return SamplingBatch(**fields)


def _kept(logits: torch.Tensor) -> list[int]:
    return torch.nonzero(logits[0] > NEG_INF).flatten().tolist()


def test_top_k_keeps_exactly_k_best():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    out = filter_logits(logits, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert _kept(out) == [1, 4]


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1]])
    logits = probs.log()
    def keep(p):
        return _kept(filter_logits(logits, torch.tensor([0]), torch.tensor([p]), torch.tensor([0.0])))
    assert keep(0.5) == [0]  # the first token alone reaches 0.5
    assert keep(0.6) == [0, 1]
    assert keep(0.9) == [0, 1, 2]
    assert keep(0.01) == [0]  # the best token always survives
    assert keep(1.0) == [0, 1, 2, 3]


def test_min_p_scales_with_the_best_token():
    logits = torch.tensor([[0.6, 0.3, 0.05, 0.05]]).log()
    def keep(m):
        return _kept(filter_logits(logits, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([m])))
    assert keep(0.1) == [0, 1]  # threshold 0.06 cuts the 0.05s
    assert keep(0.08) == [0, 1, 2, 3]  # threshold 0.048 keeps them
    assert keep(0.6) == [0]  # threshold 0.36 cuts 0.3


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 2.0, 1.0]])
    batch = _batch(1, 4, repetition_penalty=torch.tensor([2.0]), prompt_token_ids=[[0]], output_token_ids=[[1]])
    assert apply_penalties(logits, batch).tolist() == [[1.0, -4.0, 2.0, 1.0]]


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    logits = torch.zeros(1, 4)
    batch = _batch(1, 4, frequency_penalty=torch.tensor([0.5]), presence_penalty=torch.tensor([1.0]),
                   prompt_token_ids=[[3, 3]], output_token_ids=[[1, 1, 1, 2]])
    assert apply_penalties(logits, batch).tolist() == [[0.0, -2.5, -1.5, 0.0]]


def test_greedy_and_banned_tokens():
    logits = torch.tensor([[1.0, 5.0, 3.0]])
    sampler = Sampler(torch.Generator().manual_seed(0))
    assert sampler(logits.clone(), _batch(1, 3, temperature=torch.zeros(1))).token_ids.tolist() == [1]
    banned = _batch(1, 3, temperature=torch.zeros(1), banned_token_ids=[[1]])
    assert sampler(logits.clone(), banned).token_ids.tolist() == [2]


def test_a_greedy_batch_with_nothing_to_adjust_takes_the_argmax_of_the_logits_as_they_are():
    """all_greedy, no penalties, logprobs, grammar or bans: the argmax of the bfloat16 logits
    without their float32 copy, the same tokens; a ban still goes through the adjustments."""
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(3)).bfloat16()
    logits[2, [5, 700]] = logits[2].max() + 1  # a tie: the first place
    logits[0, 5] = logits[0].max() + 2  # row 0's best, banned below
    plain = _batch(8, 1000, temperature=torch.zeros(8), all_greedy=True, any_penalties=False)
    assert torch.equal(sampler(logits, plain).token_ids, logits.float().argmax(dim=-1))
    banned = _batch(8, 1000, temperature=torch.zeros(8), all_greedy=True, any_penalties=False,
                    banned_token_ids=[[5]] + [[] for _ in range(7)])
    first = logits[0].float().clone()
    first[5] = NEG_INF
    assert sampler(logits, plain).token_ids[0] == 5 and sampler(logits, banned).token_ids[0] == first.argmax() != 5


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(torch.Generator().manual_seed(0))
    rows = 6000
    tokens = sampler(probs.log().repeat(rows, 1), _batch(rows, 3)).token_ids
    freq = torch.bincount(tokens, minlength=3).float() / rows
    # 5 standard errors: this fails only for a wrong distribution, not by chance.
    assert torch.allclose(freq, probs, atol=5 * math.sqrt(0.25 / rows))


def test_seeded_row_ignores_its_neighbours():
    logits = torch.randn(1, 50)
    def draw(extra_rows: int) -> int:
        gens = [torch.Generator().manual_seed(42)] + [None] * extra_rows
        batch = _batch(1 + extra_rows, 50, generators=gens)
        all_logits = torch.cat([logits, torch.randn(extra_rows, 50)])
        return Sampler(torch.Generator().manual_seed(extra_rows))(all_logits, batch).token_ids[0].item()
    assert draw(0) == draw(3) == draw(7)


def test_logprobs_are_raw_and_ranked():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = Sampler(torch.Generator())(logits.clone(), _batch(1, 3, temperature=torch.zeros(1), num_logprobs=2,
                                                            repetition_penalty=torch.tensor([5.0]),
                                                            output_token_ids=[[1]]))
    raw = logits.log_softmax(-1)[0]
    assert out.token_ids.tolist() == [2]  # the penalty moved the choice...
    assert out.logprob_token_ids.tolist() == [[2, 1, 2]]
    torch.testing.assert_close(out.logprobs[0], raw[[2, 1, 2]])  # ...but logprobs are the model's
    assert out.sampled_ranks.tolist() == [2]


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("n", 0),
    ("max_tokens", 0), ("min_tokens", -1), ("repetition_penalty", 0.0), ("frequency_penalty", 3.0),
    ("presence_penalty", -2.5), ("logprobs", -1), ("prompt_logprobs", -1), ("top_k", 2**63), ("seed", 2**63), ("stop", [""]),
    ("seed", 1.5),
    ("temperature", float("nan")), ("max_tokens", True),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_first_argmax_is_argmax_and_takes_the_first_of_equals():
    """Greedy tokens come from max()'s indices (faster on CPU); they must be argmax's, ties
    included: speculative verification compares them with the non-speculative tokens."""
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [NEG_INF, NEG_INF, -1.0, -1.0]])
    assert first_argmax(ties).tolist() == [1, 0, 2]
    wide = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0))
    wide[3, [7, 900, 40000]] = wide[3].max() + 1  # a three-way tie past the first vector
    assert torch.equal(first_argmax(wide), wide.argmax(dim=-1)) and first_argmax(wide)[3] == 7


def test_cpu_argmax_kernel_is_torch_max_indices():
    """The C++ kernel (cpu_ops.first_argmax) gives max(dim=-1)'s indices: ties to the first, a NaN
    anywhere to the first NaN (in the vector part and in the tail past it), rows of -inf, widths
    that are no multiple of 16, and rows strided apart (a slice of a wider tensor)."""
    if cpu_ops.load() is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(1)
    for width in (1, 15, 16, 33, 49152):
        x = torch.randn(9, width + 3, generator=gen)[:, :width]  # rows strided width + 3 apart
        x[1] = NEG_INF
        x[2, -1] = x[2].max() + 1  # the maximum in the last place
        x[3, 0] = float("nan")
        x[4, width // 2:] = float("nan")
        x[5, -1] = float("nan")
        x[6] = 2.0  # all equal
        x[7, [0, width - 1]] = float(x[7].max()) + 5  # a tie between the first and last places
        assert torch.equal(cpu_ops.first_argmax(x), x.max(dim=-1).indices), width
        bf16 = x.bfloat16()  # ties where float32 values round together
        assert torch.equal(cpu_ops.first_argmax(bf16), bf16.float().max(dim=-1).indices), width
