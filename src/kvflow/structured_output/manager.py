"""StructuredOutputManager: the engine's grammars. One matcher per request, the token masks each
step samples with, and a bound on the time any of them may take.

Where it runs. The manager is the engine's: after `Scheduler.schedule()` the engine takes the
step's masks from it (`step_masks`) and ships them in the step (`SchedulerOutput.grammar`), so
whatever samples finds them there. The grammar library's work (following a request's new tokens,
then computing its next masks) runs in a job per request on the mask threads, started as soon as
the step that produced the tokens ends (`advance`). The engine thread never calls the library.

No request's grammar can hold up another's. Before scheduling, the engine waits for the jobs in
flight (`settle`), each at most MASK_WAIT_S after it began, and a request whose job still runs
then sits the step out: the scheduler holds it (it may compute prompt chunks, but not sample)
until its job is done. Such a request is marked slow and its later jobs are never waited for,
so one request can delay the engine by MASK_WAIT_S once in its life. A job past the time limit
(`structured_outputs_compile_timeout`, the compile's bound) ends its request with an error naming
the limit. There are threads for a job per running request, so a slow job never queues another.

A request whose grammar cannot go on ends with finish_reason "error" and the reason, never as a
completed match: the library gave up (its work limits: lexer fuel, parser items), no token may
follow where the grammar is not complete, or a token the grammar refuses was produced.

A matcher is a function of the tokens its request produced, and nothing else: a job brings it
level with the request's output tokens (forward over the tokens sampled since, usually one), so
preemption (the output tokens survive a recompute), prefix caching (prompt tokens are not the
grammar's business) and n > 1 (one matcher per child) need nothing of their own. With speculative
decoding a job also gives the masks after each prefix of the request's proposals, and how many of
them the grammar accepts: the engine verifies only those (`settle`'s `valid_proposals`), which
keeps the output distribution exact (rejection sampling over any prefix of the proposals is).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from kvflow.core.sched_output import StepGrammar
from kvflow.structured_output.backend import CompiledGrammar, GrammarMatcher, bitmask_width
from kvflow.structured_output.backends import check_backend, make_backend
from kvflow.structured_output.compiler import GrammarCompiler
from kvflow.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("kvflow")

# How long the engine waits, once per request, for a mask job before the step goes on without
# that request. Typical jobs take well under a millisecond; a few hundred rows of them on two
# cores stay within this.
MASK_WAIT_S = 0.05


@dataclass
class Settled:
    """What `settle` found: requests that may not sample this step, requests whose grammar broke
    (request id → why) and, per request with proposals, how many of them its grammar accepts."""

    held: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    valid_proposals: dict[str, int] = field(default_factory=dict)


class GrammarBroken(Exception):
    """A request's grammar cannot go on; the message says why, for the client."""


@dataclass
class _Request:
    """One request's grammar. `masks` (with `valid`) are the last finished job's; while `job` runs
    they are None. Only the job touches the matcher while it runs."""

    matcher: GrammarMatcher
    label: str
    masks: torch.Tensor | None
    valid: int = 0
    num_outputs: int = 0  # output tokens the matcher has been given
    job: Future | None = None
    submitted: float = 0.0
    started: float | None = None  # set by the job itself
    slow: bool = False
    ended: bool = False  # the grammar is complete and only end tokens may follow (ignore_eos)


class StructuredOutputManager:
    def __init__(self, backend: str, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 compile_timeout_s: float, max_jobs: int = 256, strict_schemas: bool = True) -> None:
        """`tokenizer`: the model's `tokenizers.Tokenizer`; `vocab_size`: the logits' width;
        `max_jobs`: mask jobs that may run at once (one per running request); `strict_schemas`: JSON
        schemas forbid the keys they do not declare (strict_schema.py)."""
        check_backend(backend)
        eos = sorted(eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.compiler = GrammarCompiler(lambda: make_backend(backend, tokenizer, vocab_size, eos, strict_schemas),
                                        compile_timeout_s)
        self.timeout_s = compile_timeout_s
        self.width = bitmask_width(vocab_size)
        self._requests: dict[str, _Request] = {}
        self._jobs = ThreadPoolExecutor(max_jobs, thread_name_prefix="kvflow-grammar-mask")
        # The mask of a request whose grammar is complete: end the sequence.
        self._eos_only = torch.zeros(self.width, dtype=torch.int32)
        for token in eos:
            if token < vocab_size:
                self._eos_only[token // 32] |= _bit(token % 32)

    # -- when a request arrives (any thread; AsyncLLM uses `compiler.compile_async`) ----------
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return self.compiler.compile(params.spec)

    # -- the engine thread -------------------------------------------------------------------
    def add_request(self, request_id: str, compiled: CompiledGrammar) -> None:
        matcher = self.compiler.backend.matcher(compiled.grammar)
        self._requests[request_id] = _Request(matcher, compiled.label, compiled.first_mask[None])

    @property
    def active(self) -> bool:
        """Some live request has a grammar (otherwise a step needs no mask at all)."""
        return bool(self._requests)

    def has_grammar(self, request_id: str) -> bool:
        return request_id in self._requests

    def advance(self, request_id: str, output_token_ids: list[int], proposals: list[int]) -> None:
        """The request produced tokens (and maybe proposals): start the job for its next masks."""
        state = self._requests.get(request_id)
        if state is None:
            return
        if state.masks is None:
            raise RuntimeError(f"request {request_id} sampled before its grammar's masks were ready")
        new_tokens = output_token_ids[state.num_outputs:]
        state.num_outputs = len(output_token_ids)
        state.masks, state.started, state.submitted = None, None, time.monotonic()
        state.job = self._jobs.submit(self._follow, state, new_tokens, list(proposals))

    def settle(self, live: Container[str]) -> Settled:
        """Collect the jobs that finished (waiting for fresh ones up to MASK_WAIT_S after they
        began). `live`: the requests not finished; the others are forgotten here, and so are
        those that failed (the engine ends them)."""
        for request_id in [r for r in self._requests if r not in live]:
            del self._requests[request_id]
        self._wait_for_fresh_jobs()
        settled, now = Settled(), time.monotonic()
        for request_id, state in list(self._requests.items()):
            if state.job is not None:
                self._collect(request_id, state, now, settled)
            if request_id in settled.failed:
                del self._requests[request_id]
            elif state.masks is not None and state.masks.shape[0] > 1:
                settled.valid_proposals[request_id] = state.valid
        return settled

    def wait_for_any(self, request_ids: Iterable[str], timeout: float) -> None:
        """Block until one of these requests' jobs is done, at most `timeout` seconds."""
        jobs = [s.job for s in map(self._requests.get, request_ids) if s is not None and s.job is not None]
        if jobs:
            wait(jobs, timeout=timeout, return_when=FIRST_COMPLETED)

    def step_masks(self, requests: list[tuple[str, int]]) -> StepGrammar | None:
        """The masks of one step's sampling rows. `requests`: (request id, proposals it verifies)
        per sampling chunk, every one of them settled and not held. None: no row has a grammar."""
        parts, first_row, row = [], {}, 0
        for request_id, num_proposals in requests:
            state = self._requests.get(request_id)
            if state is None:
                continue
            if state.masks is None or num_proposals + 1 > state.masks.shape[0]:
                raise RuntimeError(f"request {request_id} was scheduled to sample before its grammar's masks")
            parts.append(state.masks[:num_proposals + 1])
            first_row[request_id] = row
            row += num_proposals + 1
        return StepGrammar(torch.cat(parts), first_row) if parts else None

    def shutdown(self) -> None:
        self._jobs.shutdown(wait=False, cancel_futures=True)
        self.compiler.shutdown()

    # -- settling ----------------------------------------------------------------------------
    def _wait_for_fresh_jobs(self) -> None:
        fresh = [s for s in self._requests.values() if s.job is not None and not s.job.done() and not s.slow]
        if fresh:
            began = min(s.started or s.submitted for s in fresh)
            wait([s.job for s in fresh], timeout=max(0.0, began + MASK_WAIT_S - time.monotonic()))

    def _collect(self, request_id: str, state: _Request, now: float, settled: Settled) -> None:
        if not state.job.done():
            state.slow = True
            if state.started is not None and now - state.started > self.timeout_s:
                settled.failed[request_id] = (
                    f"{state.label} could not be followed: the mask for output token {state.num_outputs + 1} took "
                    f"longer than {self.timeout_s:g} s (the limit is structured_outputs_compile_timeout)")
            else:
                settled.held.add(request_id)
            return
        job, state.job = state.job, None
        try:
            state.masks, state.valid = job.result()
        except GrammarBroken as e:
            settled.failed[request_id] = f"{state.label} could not be followed: {e}"
        except Exception as e:  # a library fault: this request's alone
            logger.exception("grammar mask job of request %s failed", request_id)
            settled.failed[request_id] = f"{state.label} could not be followed: the grammar library failed ({e})"

    # -- the mask threads ----------------------------------------------------------------------
    def _follow(self, state: _Request, new_tokens: list[int], proposals: list[int]) -> tuple[torch.Tensor, int]:
        """Give the matcher the request's new tokens, then fill the masks after each prefix of
        `proposals` the grammar accepts (the rest allow only the end: verification rejects the
        proposal there, so they are never used). Returns (masks, accepted proposals)."""
        state.started = time.monotonic()
        masks = self._eos_only.repeat(len(proposals) + 1, 1)
        matcher = state.matcher
        if new_tokens and not state.ended:
            self._accept(state, new_tokens)
        if state.ended or matcher.is_terminated():
            return masks, 0
        valid = matcher.validate_tokens(proposals) if proposals else 0
        stepped = 0
        for j in range(valid + 1):
            if matcher.is_terminated():
                break
            matcher.fill_bitmask(masks, j)
            _raise_if_given_up(matcher)
            if not masks[j].any():  # a dead end: no proposal may lead here
                if j == 0:
                    raise GrammarBroken("no token may follow the output so far, and it is not complete")
                valid = j - 1
                break
            if j < valid:
                matcher.accept_tokens([proposals[j]])
                stepped += 1
        matcher.rollback(stepped)
        return masks, valid

    def _accept(self, state: _Request, new_tokens: list[int]) -> None:
        before = state.matcher.num_tokens
        if state.matcher.accept_tokens(new_tokens):
            _raise_if_given_up(state.matcher)
            return
        _raise_if_given_up(state.matcher)
        refused = new_tokens[state.matcher.num_tokens - before]
        if refused not in self.eos_token_ids:  # only the library can let through what it refuses
            raise GrammarBroken(f"the grammar library refused token {refused} after its mask had allowed it "
                                "(it may have reached one of its work limits)")
        state.ended = True  # ignore_eos: end tokens go on past the grammar's end; the text still matches


def _raise_if_given_up(matcher: GrammarMatcher) -> None:
    error = matcher.error()
    if error is not None:
        raise GrammarBroken(f"the grammar library gave up ({error})")


def _bit(index: int) -> int:
    """Bit `index` of an int32 word, as the int32 value torch stores (bit 31 is the sign)."""
    return 1 << index if index < 31 else -(1 << 31)
