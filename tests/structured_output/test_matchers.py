"""Both grammar backends behind one interface, against the default model's vocabulary: masks
allow exactly the tokens the matcher then accepts, and the matcher moves back (rollback) and
looks ahead (validate) without losing its place — what speculative decoding needs of it."""

from __future__ import annotations

import json

import pytest
import torch

from kvflow.structured_output.backend import bitmask_width
from kvflow.structured_output.backends import make_backend
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


def masks_after(manager, outputs: list[int], proposals: list[int] = ()) -> tuple[torch.Tensor, int]:
    """What the engine does after a step that produced `outputs` (and proposed `proposals`): start
    the request's job, settle it, take the step's rows. Returns (rows, proposals it verifies)."""
    manager.advance("r", outputs, list(proposals))
    settled = manager.settle({"r"})
    assert not settled.held and not settled.failed, settled
    valid = settled.valid_proposals.get("r", 0)
    grammar = manager.step_masks([("plain", 0), ("r", valid)])
    assert grammar.first_row == {"r": 0}
    return grammar.bitmask, valid


def test_manager_follows_the_output(manager, backend, tokenizer, eos_ids):
    _, tokens, masks = walk(backend, tokenizer, eos_ids)
    first = manager.step_masks([("r", 0)])  # the compile's first mask: no job needed
    assert torch.equal(first.bitmask, masks[0])
    for n in (1, 2, 5, len(tokens) - 1):
        rows, _ = masks_after(manager, tokens[:n])
        assert torch.equal(rows, masks[n])
    assert manager.step_masks([("plain", 0)]) is None  # no row with a grammar: nothing to do


def test_speculative_masks_and_valid_prefix(manager, backend, tokenizer, eos_ids):
    _, tokens, masks = walk(backend, tokenizer, eos_ids)
    bad = tokenizer.encode("{", add_special_tokens=False)
    # tokens: '{"', 'name', '":', ' "', ... — a brace right after '":' is refused (name is a string)
    rows, valid = masks_after(manager, tokens[:1], tokens[1:5])
    assert valid == 4 and all(torch.equal(rows[j:j + 1], masks[1 + j]) for j in range(5))
    rows, valid = masks_after(manager, tokens[:2], tokens[2:3] + bad + tokens[3:5])
    assert valid == 1 and all(torch.equal(rows[j:j + 1], masks[2 + j]) for j in range(2))
    assert bad[0] not in allowed(rows, 1)  # so verification would reject it, were it verified
    # ending on the end token: the row after it allows only the end
    rows, valid = masks_after(manager, tokens[:-2], tokens[-2:] + tokens[:1])
    assert valid == 2 and torch.equal(rows[:2], torch.cat(masks[-2:])) and allowed(rows, 2) == set(eos_ids)


def test_a_refused_output_token_breaks_the_grammar_and_the_request_is_forgotten(manager, tokenizer):
    bad = tokenizer.encode("nope", add_special_tokens=False)
    manager.advance("r", bad, [])
    settled = manager.settle({"r"})
    assert settled.failed == {"r": f"the JSON schema could not be followed: the grammar library refused token {bad[0]} "
                                    "after its mask had allowed it (it may have reached one of its work limits)"}
    assert not manager.active and manager.step_masks([("r", 0)]) is None


def test_past_the_end_only_end_tokens_may_follow(manager, backend, tokenizer, eos_ids):
    _, tokens, _ = walk(backend, tokenizer, eos_ids)
    rows, _ = masks_after(manager, tokens + [eos_ids[0]] * 2)  # ignore_eos: the end token again and again
    assert allowed(rows) == set(eos_ids)
