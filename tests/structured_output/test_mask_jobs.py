"""The manager's mask jobs, with a stand-in grammar library whose matchers we control: a slow
job holds only its own request out of the step (the others' masks are ready) and is waited for
once, never again; a job past the time limit ends its request with an error naming the limit;
a library that gives up, or a dead end, ends the request with an error saying so; each request's
job runs on a thread of its own, so a slow one never queues another; and the engine-side
requests that ended are forgotten at the next settle."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvflow.structured_output import manager as manager_module
from kvflow.structured_output.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from kvflow.structured_output.manager import StructuredOutputManager

VOCAB = 64
EOS = 63


class StandInMatcher(GrammarMatcher):
    """Allows token 1 everywhere. `gate`: fill_bitmask waits for it; `gives_up_at` / `dead_end_at`:
    after that many tokens the library reports an error / allows nothing."""

    def __init__(self, gate: threading.Event | None = None, gives_up_at: int | None = None,
                 dead_end_at: int | None = None) -> None:
        super().__init__()
        self.gate, self.gives_up_at, self.dead_end_at = gate, gives_up_at, dead_end_at
        self.filled_on: set[str] = set()

    def accept_tokens(self, tokens):
        self.num_tokens += len(tokens)
        return True

    def validate_tokens(self, tokens):
        return len(tokens)

    def rollback(self, num_tokens):
        self.num_tokens -= num_tokens

    def fill_bitmask(self, bitmask, row):
        self.filled_on.add(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(30)
        bitmask[row] = 0  # as the libraries do, the whole row is written
        if self.num_tokens != self.dead_end_at:
            bitmask[row, 0] = 0b10

    def is_terminated(self):
        return False

    def error(self):
        return "lexer error: too many expressions" if self.num_tokens == self.gives_up_at else None


class StandInBackend(GrammarBackend):
    name = "stand-in"
    vocab_size = VOCAB

    def __init__(self) -> None:
        self.next_matchers: list[StandInMatcher] = []

    def compile(self, spec):
        raise NotImplementedError

    def matcher(self, compiled):
        return self.next_matchers.pop(0)


def make_manager(timeout_s: float = 30.0) -> tuple[StructuredOutputManager, StandInBackend]:
    manager = StructuredOutputManager("guidance", None, VOCAB, [EOS], timeout_s)
    backend = StandInBackend()
    manager.compiler._backend = backend  # the stand-in instead of llguidance (never built: no tokenizer)
    return manager, backend


def add(manager, backend, request_id: str, matcher: StandInMatcher) -> StandInMatcher:
    backend.next_matchers.append(matcher)
    first = torch.zeros(2, dtype=torch.int32)
    first[0] = 0b10
    manager.add_request(request_id, CompiledGrammar(None, first, "the regex"))
    return matcher


@pytest.fixture
def pair():
    manager, backend = make_manager()
    gate = threading.Event()
    slow = add(manager, backend, "slow", StandInMatcher(gate=gate))
    add(manager, backend, "quick", StandInMatcher())
    yield manager, gate, slow
    gate.set()
    manager.shutdown()


@pytest.mark.timeout(60)
def test_a_slow_job_holds_only_its_request_and_is_waited_for_once(pair, monkeypatch):
    manager, gate, slow = pair
    monkeypatch.setattr(manager_module, "MASK_WAIT_S", 0.05)
    for request_id in ("slow", "quick"):
        manager.advance(request_id, [1], [])
    settled = manager.settle({"slow", "quick"})
    assert settled.held == {"slow"} and not settled.failed
    grammar = manager.step_masks([("quick", 0)])  # the other request samples as usual
    assert grammar.first_row == {"quick": 0} and grammar.bitmask[0, 0] == 0b10
    with pytest.raises(RuntimeError, match="before its grammar's masks"):
        manager.step_masks([("slow", 0)])
    # Known slow now: a settle no longer waits for it at all (a wait would outlast the test's timeout).
    monkeypatch.setattr(manager_module, "MASK_WAIT_S", 1000.0)
    manager.advance("quick", [1, 1], [])
    assert manager.settle({"slow", "quick"}).held == {"slow"}
    gate.set()
    manager.wait_for_any({"slow"}, 30)
    assert manager.settle({"slow", "quick"}).held == set()
    assert manager.step_masks([("slow", 0), ("quick", 0)]).first_row == {"slow": 0, "quick": 1}


@pytest.mark.timeout(60)
def test_jobs_run_on_threads_of_their_own(pair):
    manager, gate, slow = pair
    manager.advance("slow", [1], [])
    manager.advance("quick", [1], [])  # not queued behind the blocked job
    quick = manager._requests["quick"].job
    assert quick.result(timeout=30)[0][0, 0] == 0b10
    assert threading.main_thread().name not in slow.filled_on


@pytest.mark.timeout(60)
def test_a_job_past_the_time_limit_ends_its_request_naming_the_limit(monkeypatch):
    manager, backend = make_manager(timeout_s=0.1)
    monkeypatch.setattr(manager_module, "MASK_WAIT_S", 0.0)
    gate = threading.Event()
    add(manager, backend, "r", StandInMatcher(gate=gate))
    manager.advance("r", [1, 1], [])
    while manager._requests["r"].started is None:
        time.sleep(0.01)
    time.sleep(0.2)
    settled = manager.settle({"r"})
    assert settled.failed == {"r": "the regex could not be followed: the mask for output token 3 took longer than "
                                   "0.1 s (the limit is structured_outputs_compile_timeout)"}
    assert not manager.active  # forgotten: the engine ends it
    gate.set()
    manager.shutdown()


@pytest.mark.parametrize("matcher, message", [
    (StandInMatcher(gives_up_at=1), "the grammar library gave up (lexer error: too many expressions)"),
    (StandInMatcher(dead_end_at=1), "no token may follow the output so far, and it is not complete"),
])
def test_a_grammar_that_cannot_go_on_ends_its_request_with_why(matcher, message):
    manager, backend = make_manager()
    add(manager, backend, "r", matcher)
    add(manager, backend, "other", StandInMatcher())
    manager.advance("r", [1], [])
    manager.advance("other", [1], [])
    settled = manager.settle({"r", "other"})
    assert settled.failed == {"r": f"the regex could not be followed: {message}"} and not settled.held
    assert manager.step_masks([("r", 0), ("other", 0)]).first_row == {"other": 0}
    manager.shutdown()


def test_a_dead_end_after_a_proposal_cuts_the_proposals_before_it():
    manager, backend = make_manager()
    add(manager, backend, "r", StandInMatcher(dead_end_at=3))
    manager.advance("r", [1], [1, 1, 1])  # after the second proposal nothing may follow
    settled = manager.settle({"r"})
    assert settled.valid_proposals == {"r": 1} and not settled.failed
    manager.shutdown()


def test_requests_that_ended_are_forgotten_at_the_next_settle():
    manager, backend = make_manager()
    add(manager, backend, "gone", StandInMatcher())
    add(manager, backend, "kept", StandInMatcher())
    manager.settle({"kept"})
    assert not manager.has_grammar("gone") and manager.has_grammar("kept")
    manager.shutdown()
