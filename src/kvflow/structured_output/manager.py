"""StructuredOutputManager: per request, a grammar matcher that follows the request's tokens and
says which tokens may come next.

The engine compiles a request's grammar when the request arrives (`compile`, refusing bad ones
with a ValueError before anything is queued) and registers it (`add_request`). The model runner
starts the step's bitmask before the forward pass (`start_bitmask`) and takes it right before
sampling; it drops finished requests (`free`).

Filling a mask is the grammar library's work (a walk of the token trie per request, a fraction
of a millisecond each); it runs on a fill thread while the engine thread runs the forward pass,
which does not depend on it. At most one fill is in flight, and whatever else touches a matcher
waits for it first, so a matcher is only ever used by one thread at a time.

A matcher is a function of the tokens its request produced, and nothing else: before filling a
mask it is brought level with the request's output tokens — forward over the tokens sampled since
(usually one), back over any it is ahead by. So preemption (the output tokens survive a
recompute), prefix caching (prompt tokens are not the grammar's business) and n > 1 (one matcher
per child) need nothing of their own, and a speculative step may move it freely as long as it
moves it back (`speculative_bitmask`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from kvflow.structured_output.backend import GrammarMatcher, bitmask_width, check_backend, make_backend
from kvflow.structured_output.compiler import GrammarCompiler
from kvflow.structured_output.params import StructuredOutputsParams


@dataclass
class GrammarBitmask:
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32 on the CPU; bit set = allowed
    rows: list[int]  # the logits row each bitmask row applies to


class StructuredOutputManager:
    def __init__(self, backend: str, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 compile_timeout_s: float) -> None:
        """`tokenizer`: the model's `tokenizers.Tokenizer`; `vocab_size`: the logits' width."""
        check_backend(backend)
        eos = sorted(eos_token_ids)
        self.compiler = GrammarCompiler(lambda: make_backend(backend, tokenizer, vocab_size, eos), compile_timeout_s)
        self.width = bitmask_width(vocab_size)
        self._grammars: dict[str, object] = {}  # request id → its compiled grammar
        self._matchers: dict[str, GrammarMatcher] = {}  # made at the request's first mask
        self._broken: set[str] = set()  # produced a token its grammar refused
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="kvflow-grammar-fill")
        self._fill: Future | None = None  # the fill in flight, if any
        # The mask of a request whose grammar cannot go on: end the sequence.
        self._eos_only = torch.zeros(self.width, dtype=torch.int32)
        for token in eos:
            if token < vocab_size:
                self._eos_only[token // 32] |= _bit(token % 32)

    # -- when a request arrives (any thread; AsyncLLM uses `compiler.compile_async`) ----------
    def compile(self, params: StructuredOutputsParams) -> object:
        return self.compiler.compile(params.spec)

    # -- the engine thread -------------------------------------------------------------------
    def add_request(self, request_id: str, compiled: object) -> None:
        self._grammars[request_id] = compiled

    @property
    def active(self) -> bool:
        """Some live request has a grammar (otherwise a step needs no mask at all)."""
        return bool(self._grammars)

    def has_grammar(self, request_id: str) -> bool:
        return request_id in self._grammars

    def free(self, request_ids) -> None:
        self._settle()
        for request_id in request_ids:
            self._grammars.pop(request_id, None)
            self._matchers.pop(request_id, None)
            self._broken.discard(request_id)

    def bitmask(self, requests: list[tuple[str, list[int]]]) -> GrammarBitmask | None:
        """The masks of one sampling step. `requests`: (request id, its output token ids) per
        logits row; rows of requests without a grammar are left out. None: no row has one."""
        pending = self.start_bitmask(requests)
        return None if pending is None else pending.result()

    def start_bitmask(self, requests: list[tuple[str, list[int]]]) -> Future | None:
        """`bitmask`, filled on the fill thread: the future's result is the GrammarBitmask (or the
        fill's exception). Matchers are levelled here, on the caller's thread."""
        self._settle()
        rows = [i for i, (request_id, _) in enumerate(requests) if request_id in self._grammars]
        if not rows:
            return None
        bitmask = torch.empty(len(rows), self.width, dtype=torch.int32)
        matchers, targets = [], []
        for target, row in enumerate(rows):
            request_id, output_token_ids = requests[row]
            matcher = self._level(request_id, output_token_ids)
            if matcher is None or matcher.is_terminated():  # (ignore_eos went past the end)
                bitmask[target] = self._eos_only
            else:
                matchers.append(matcher)
                targets.append(target)
        self._fill = self._filler.submit(self._fill_rows, matchers, targets, GrammarBitmask(bitmask, rows))
        return self._fill

    def _fill_rows(self, matchers: list[GrammarMatcher], targets: list[int], masks: GrammarBitmask) -> GrammarBitmask:
        if matchers:
            self.compiler.backend.fill_bitmasks(matchers, targets, masks.bitmask)
        return masks

    def _settle(self) -> None:
        """Wait for the fill in flight (its error, if any, was the step's that took it)."""
        if self._fill is not None:
            wait([self._fill])
            self._fill = None

    def valid_prefix(self, request_id: str, output_token_ids: list[int], proposed: list[int]) -> int:
        """How many leading `proposed` tokens the request's grammar accepts after its output
        (all of them for a request without a grammar): proposals are cut there before they
        are verified."""
        self._settle()
        if request_id not in self._grammars:
            return len(proposed)
        matcher = self._level(request_id, output_token_ids)
        return 0 if matcher is None else matcher.validate_tokens(proposed)

    def speculative_bitmask(self, request_id: str, output_token_ids: list[int], proposed: list[int]) -> torch.Tensor:
        """The masks for verifying `proposed` (a request with a grammar): row j is the mask after
        the output and proposed[:j], for j = 0..len(proposed). Rows past the first proposed token
        the grammar refuses (or past an end of sequence) allow only the end: verification rejects
        that token there, so what those rows say is never used. The matcher ends where it began."""
        self._settle()
        bitmask = self._eos_only.repeat(len(proposed) + 1, 1)
        matcher = self._level(request_id, output_token_ids)
        if matcher is None:
            return bitmask
        valid = matcher.validate_tokens(proposed)
        for j in range(valid + 1):
            if matcher.is_terminated():
                break
            matcher.fill_bitmask(bitmask, j)
            if j < valid:
                matcher.accept_tokens([proposed[j]])
        matcher.rollback(matcher.num_tokens - len(output_token_ids))
        return bitmask

    def _level(self, request_id: str, output_token_ids: list[int]) -> GrammarMatcher | None:
        """The request's matcher, level with its output; None if its grammar cannot go on."""
        if request_id in self._broken:
            return None
        matcher = self._matchers.get(request_id)
        if matcher is None:
            matcher = self._matchers[request_id] = self.compiler.backend.matcher(self._grammars[request_id])
        produced = len(output_token_ids)
        if matcher.num_tokens > produced:
            matcher.rollback(matcher.num_tokens - produced)
        elif matcher.num_tokens < produced and not matcher.accept_tokens(output_token_ids[matcher.num_tokens:]):
            # Only a token the mask allowed can be sampled, so this means the request outlived
            # its grammar (ignore_eos) or min_tokens overruled the grammar's end: end it.
            self._broken.add(request_id)
            return None
        return matcher


def _bit(index: int) -> int:
    """Bit `index` of an int32 word, as the int32 value torch stores (bit 31 is the sign)."""
    return 1 << index if index < 31 else -(1 << 31)
