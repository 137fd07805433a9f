"""Both grammar backends behind one interface, against the default model's vocabulary: masks
allow exactly the tokens the matcher then accepts, and the matcher moves back (rollback) and
looks ahead (validate) without losing its place — what speculative decoding needs of it."""

from __future__ import annotations

import json

import pytest
import torch

from kvflow.structured_output.backend import bitmask_width, make_backend
from kvflow.structured_output.manager import StructuredOutputManager
from kvflow.structured_output.params import StructuredOutputsParams

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 2}},
          "required": ["name", "tags"], "additionalProperties": False}
VALID = json.dumps({"name": "Bob", "tags": ["bb", "a"]})


@pytest.fixture(scope="module", params=["guidance", "xgrammar"])
def backend(request, tokenizer, eos_ids):
    return make_backend(request.param, tokenizer.backend, VOCAB, eos_ids)


def allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    bits = (bitmask[row, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:VOCAB].nonzero().flatten().tolist())


def mask_of(matcher) -> torch.Tensor:
    bitmask = torch.zeros(1, bitmask_width(VOCAB), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask


def walk(backend, tokenizer, eos_ids):
    """A fresh matcher, the tokens of a valid output plus EOS, and the mask before each."""
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(json=SCHEMA).spec))
    tokens = tokenizer.encode(VALID, add_special_tokens=False) + [eos_ids[0]]
    masks = []
    for token in tokens:
        masks.append(mask_of(matcher))
        assert token in allowed(masks[-1])
        assert matcher.accept_tokens([token])
    return matcher, tokens, masks


def test_masks_allow_the_accepted_tokens_and_end_only_at_the_end(backend, tokenizer, eos_ids):
    matcher, tokens, masks = walk(backend, tokenizer, eos_ids)
    assert matcher.is_terminated() and matcher.num_tokens == len(tokens)
    assert eos_ids[0] not in allowed(masks[0])  # the empty string is not an object
    assert allowed(masks[-1]) == {eos_ids[0]}  # after the closing brace only the end
    assert not matcher.accept_tokens(tokenizer.encode("x", add_special_tokens=False))  # nothing after it
    assert not matcher.accept_tokens([eos_ids[0]])  # not even another end
    assert matcher.num_tokens == len(tokens)


def test_rollback_returns_to_every_earlier_state(backend, tokenizer, eos_ids):
    matcher, tokens, masks = walk(backend, tokenizer, eos_ids)
    for k in (1, 3, len(tokens) - 1, len(tokens)):
        matcher.rollback(k)
        assert matcher.num_tokens == len(tokens) - k and not matcher.is_terminated()
        assert torch.equal(mask_of(matcher), masks[len(tokens) - k])
        assert matcher.accept_tokens(tokens[len(tokens) - k:])  # and forward again, to the end
        assert matcher.is_terminated()
    with pytest.raises(ValueError, match="cannot roll back"):
        matcher.rollback(len(tokens) + 1)


def test_validate_counts_the_accepted_prefix_and_moves_nothing(backend, tokenizer, eos_ids):
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(json=SCHEMA).spec))
    tokens = tokenizer.encode(VALID, add_special_tokens=False)
    bad = tokenizer.encode("{", add_special_tokens=False)  # a second brace right after the first
    start = mask_of(matcher)
    assert matcher.validate_tokens(tokens + [eos_ids[0]]) == len(tokens) + 1
    assert matcher.validate_tokens(tokens + [eos_ids[0], eos_ids[0]]) == len(tokens) + 1
    assert matcher.validate_tokens(tokens[:1] + bad + tokens[1:]) == 1
    assert matcher.validate_tokens(tokens[:-1] + [eos_ids[0]]) == len(tokens) - 1  # unfinished: no end yet
    assert matcher.num_tokens == 0 and torch.equal(mask_of(matcher), start)
    # accept_tokens keeps the valid prefix of a refused list
    assert not matcher.accept_tokens(tokens[:2] + bad)
    assert matcher.num_tokens == 2


def test_regex_choice_and_grammar_masks(backend, tokenizer, eos_ids):
    cases = [(StructuredOutputsParams(regex=r"[0-9]{2}-[a-z]{1,3}"), "42-ab"),
             (StructuredOutputsParams(choice=["yes", "no way"]), "no way"),
             (StructuredOutputsParams(grammar='root ::= "(" num ")" | num\nnum ::= [0-9]+'), "(12)")]
    for params, text in cases:
        matcher = backend.matcher(backend.compile(params.spec))
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert token in allowed(mask_of(matcher))
            assert matcher.accept_tokens([token])
        assert eos_ids[0] in allowed(mask_of(matcher))


@pytest.fixture
def manager(backend, tokenizer, eos_ids):
    manager = StructuredOutputManager(backend.name, tokenizer.backend, VOCAB, eos_ids, compile_timeout_s=60)
    manager.add_request("r", manager.compile(StructuredOutputsParams(json=SCHEMA)))
    return manager


def test_manager_follows_the_output_forward_and_back(manager, backend, tokenizer, eos_ids):
    _, tokens, masks = walk(backend, tokenizer, eos_ids)
    # Any order of output lengths: preemption keeps the output, a speculative step may move back.
    for n in (0, 5, 2, len(tokens) - 1, 1, 7, 0, 3):
        out = manager.bitmask([("plain", [11, 12]), ("r", tokens[:n])])
        assert out.rows == [1] and torch.equal(out.bitmask, masks[n])
    assert manager.bitmask([("plain", [])]) is None  # no row with a grammar: nothing to do


def test_speculative_masks_and_valid_prefix(manager, backend, tokenizer, eos_ids):
    _, tokens, masks = walk(backend, tokenizer, eos_ids)
    bad = tokenizer.encode("{", add_special_tokens=False)
    # tokens: '{"', 'name', '":', ' "', ... — a brace right after '":' is refused (name is a string)
    assert manager.valid_prefix("r", tokens[:1], tokens[1:5]) == 4
    assert manager.valid_prefix("r", tokens[:1], tokens[1:3] + bad + tokens[3:5]) == 2
    assert manager.valid_prefix("no grammar", [], bad) == 1
    rows = manager.speculative_bitmask("r", tokens[:1], tokens[1:5])
    assert all(torch.equal(rows[j:j + 1], masks[1 + j]) for j in range(5))
    rows = manager.speculative_bitmask("r", tokens[:1], tokens[1:3] + bad + tokens[3:5])
    assert all(torch.equal(rows[j:j + 1], masks[1 + j]) for j in range(3))
    assert bad[0] not in allowed(rows, 2)  # so verification rejects it
    assert allowed(rows, 3) == allowed(rows, 4) == set(eos_ids)  # past it: rows never used
    # ending on the end token, then nothing
    rows = manager.speculative_bitmask("r", tokens[:-2], tokens[-2:] + tokens[:1])
    assert torch.equal(rows[:2], torch.cat(masks[-2:])) and allowed(rows, 2) == set(eos_ids)
    # the matcher is back where the output leaves it
    assert torch.equal(manager.bitmask([("r", tokens[:1])]).bitmask, masks[1])


def test_a_refused_output_token_ends_the_request(manager, tokenizer, eos_ids):
    bad = tokenizer.encode("nope", add_special_tokens=False)
    out = manager.bitmask([("r", bad)])
    assert allowed(out.bitmask) == set(eos_ids)
    manager.free(["r"])
    assert manager.bitmask([("r", bad)]) is None
