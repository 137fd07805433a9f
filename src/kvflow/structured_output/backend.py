"""The interface every grammar library sits behind (`backends.py` chooses one).

A backend compiles a `GrammarSpec` once (the result is shared, read-only, by every request with
that spec) and makes one `GrammarMatcher` per request from it. A matcher's whole job: fill the
request's row of a token bitmask (bit t of row r set = token t allowed), and follow the tokens the
request actually produced — forward by any number, back by any number (speculative decoding
proposes several tokens and keeps a prefix of them).

Bitmasks are int32 CPU tensors of shape [rows, ceil(vocab / 32)], the layout both libraries fill.

`prepare` is what the compiler runs for a spec: the compile and the mask of the output's first
token. Both libraries do real work at that first mask (llguidance builds its lexer lazily, so a
regex can compile in a millisecond and take seconds to give its first mask), so it counts toward
the compile's time limit, and a constraint that cannot even start is refused before it is queued.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvflow.structured_output.params import GrammarSpec


class GrammarMatcher(ABC):
    def __init__(self) -> None:
        self.num_tokens = 0  # tokens accepted so far (and not rolled back)

    @abstractmethod
    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance by `tokens`. On the first token the grammar refuses, stop before it and return
        False (the tokens before it stay accepted)."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar would accept, in order; the state does not change."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]`; the state does not change."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and the end-of-sequence token was accepted."""

    def error(self) -> str | None:
        """Why the library gave up on this matcher (a limit of its lexer or parser), if it did:
        its masks mean nothing from then on."""
        return None


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled, shared read-only by the matchers of every request that asks for it."""

    grammar: object  # the library's compiled form
    first_mask: torch.Tensor  # [ceil(vocab / 32)] int32: the tokens an output may start with
    label: str  # what it was compiled from, for errors ("the regex")


class GrammarBackend(ABC):
    name: str
    vocab_size: int  # the logits' width, which the bitmasks cover

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> object:
        """The compiled grammar; ValueError with the library's explanation if it is invalid or
        unsupported. Runs on a compiler thread, never on the engine's."""

    @abstractmethod
    def matcher(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""

    def prepare(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar and its first mask; ValueError if it is invalid or cannot start."""
        grammar = self.compile(spec)
        matcher = self.matcher(grammar)
        mask = torch.zeros(1, bitmask_width(self.vocab_size), dtype=torch.int32)
        matcher.fill_bitmask(mask, 0)
        error = matcher.error()
        if error is not None:
            raise ValueError(f"the grammar library gave up on its first token: {error}")
        if not mask.any():
            raise ValueError("no output can satisfy it (no token may start one)")
        return CompiledGrammar(grammar, mask[0], spec.label)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
