"""The step's bitmask is filled on the manager's fill thread (during the forward pass), in one
batched library call: it must equal what each matcher fills on its own, row for row, for a batch
that mixes grammars with a finished, a broken and an unconstrained request; and a fill that fails
is that step's error, raised where the step takes the mask, never a hang for the next one."""

from __future__ import annotations

import threading

import pytest
import torch

from kvflow.structured_output.backend import bitmask_width, make_backend
from kvflow.structured_output.manager import StructuredOutputManager
from kvflow.structured_output.params import StructuredOutputsParams

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
CASES = {  # request id: (its constraint, the text it has produced so far)
    "json": (StructuredOutputsParams(json=SCHEMA), '{"name": "Bo'),
    "json-again": (StructuredOutputsParams(json=SCHEMA), '{"na'),  # same grammar, another state
    "regex": (StructuredOutputsParams(regex=r"[0-9]{2}-[a-z]{1,3}"), "42-"),
    "choice": (StructuredOutputsParams(choice=["yes", "no way"]), "no"),
    "done": (StructuredOutputsParams(choice=["yes", "no way"]), "yes"),  # then the end token
    "broken": (StructuredOutputsParams(regex=r"[0-9]+"), "7"),  # then a token it refuses
}


@pytest.fixture(scope="module", params=["guidance", "xgrammar"])
def backend_name(request):
    return request.param


def outputs(tokenizer, eos_ids) -> dict[str, list[int]]:
    produced = {rid: tokenizer.encode(text, add_special_tokens=False) for rid, (_, text) in CASES.items()}
    produced["done"] = produced["done"] + [eos_ids[0]]
    produced["broken"] = produced["broken"] + tokenizer.encode("x", add_special_tokens=False)
    return produced


def allowed(row: torch.Tensor) -> set[int]:
    bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:VOCAB].nonzero().flatten().tolist())


def alone(backend, params: StructuredOutputsParams, tokens: list[int]) -> torch.Tensor:
    """The row a fresh matcher fills by itself after `tokens`."""
    matcher = backend.matcher(backend.compile(params.spec))
    assert matcher.accept_tokens(tokens)
    row = torch.zeros(1, bitmask_width(VOCAB), dtype=torch.int32)
    matcher.fill_bitmask(row, 0)
    return row


def test_the_batched_threaded_fill_equals_each_matcher_alone(backend_name, tokenizer, eos_ids):
    manager = StructuredOutputManager(backend_name, tokenizer.backend, VOCAB, eos_ids, compile_timeout_s=60)
    for rid, (params, _) in CASES.items():
        manager.add_request(rid, manager.compile(params))
    produced = outputs(tokenizer, eos_ids)
    order = ["plain", "json", "done", "regex", "broken", "json-again", "choice"]
    requests = [(rid, produced.get(rid, [5, 6])) for rid in order]
    fills = []
    fill_bitmasks = type(manager.compiler.backend).fill_bitmasks

    def recorded(self, matchers, rows, bitmask):  # where and how the rows are filled
        fills.append((threading.current_thread() is not threading.main_thread(), len(matchers)))
        fill_bitmasks(self, matchers, rows, bitmask)

    manager.compiler.backend.fill_bitmasks = recorded.__get__(manager.compiler.backend)
    out = manager.bitmask(requests)
    assert fills == [(True, 4)]  # one call for the rows a grammar fills (not done's or broken's), off this thread
    assert out.rows == [1, 2, 3, 4, 5, 6]  # "plain" has no grammar: no row
    backend = make_backend(backend_name, tokenizer.backend, VOCAB, eos_ids)
    for target, row in enumerate(out.rows):
        rid = order[row]
        if rid not in ("done", "broken"):
            assert torch.equal(out.bitmask[target:target + 1], alone(backend, CASES[rid][0], produced[rid])), rid
    # Past the end (ignore_eos) or past a refused token, a request may only end.
    assert allowed(out.bitmask[1]) == allowed(out.bitmask[3]) == set(eos_ids)


class FailingFill(Exception):
    pass


@pytest.fixture
def one_request(tokenizer, eos_ids):
    """A manager with request "r" under the JSON schema, its output so far and its constraint."""
    manager = StructuredOutputManager("guidance", tokenizer.backend, VOCAB, eos_ids, compile_timeout_s=60)
    params, text = CASES["json"]
    manager.add_request("r", manager.compile(params))
    return manager, tokenizer.encode(text, add_special_tokens=False), params


def test_a_failed_fill_is_the_steps_error_and_the_next_step_goes_on(one_request):
    manager, tokens, params = one_request
    backend = manager.compiler.backend

    def failing(matchers, rows, bitmask):
        raise FailingFill("the grammar library failed")

    backend.fill_bitmasks = failing
    pending = manager.start_bitmask([("r", tokens), ("other", [1])])
    with pytest.raises(FailingFill):
        pending.result(timeout=30)
    del backend.fill_bitmasks  # the library works again
    manager.free(["gone"])  # waits for nothing: the failed fill is over
    out = manager.bitmask([("r", tokens)])
    assert torch.equal(out.bitmask, alone(backend, params, tokens))


def test_whatever_touches_a_matcher_waits_for_the_fill_in_flight(one_request):
    manager, tokens, params = one_request
    backend = manager.compiler.backend
    release, filling = threading.Event(), threading.Event()
    fill_bitmasks = type(backend).fill_bitmasks

    def slow(matchers, rows, bitmask):
        filling.set()
        assert release.wait(30)
        fill_bitmasks(backend, matchers, rows, bitmask)

    backend.fill_bitmasks = slow
    pending = manager.start_bitmask([("r", tokens)])
    assert filling.wait(30)
    spec_done = threading.Event()
    # A speculative step right after (same request, further along) must not move the matcher
    # under the fill.
    worker = threading.Thread(target=lambda: (manager.valid_prefix("r", tokens, tokens[:1]), spec_done.set()))
    worker.start()
    assert not spec_done.wait(0.2)  # it waits for the fill
    release.set()
    worker.join(30)
    assert spec_done.is_set()
    del backend.fill_bitmasks
    assert torch.equal(pending.result(timeout=30).bitmask, alone(backend, params, tokens))
