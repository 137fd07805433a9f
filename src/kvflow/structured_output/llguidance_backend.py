"""The default backend: llguidance (Rust, no dependencies; CPU wheels on PyPI).

It builds a grammar's parser and lexer lazily, so compiling is cheap (a millisecond for typical
JSON schemas, where xgrammar precomputes masks for up to seconds) and each mask is computed as the
tokens come, bounded by the library's "fuel" limits rather than by time. Grammar construction and
mask computation release the GIL.
"""

from __future__ import annotations

import json

import llguidance
import torch

from kvflow.structured_output.backend import GrammarBackend, GrammarMatcher
from kvflow.structured_output.params import GrammarSpec
from kvflow.structured_output.strict_schema import closed_schema_text

# JSON as json.dumps writes it: one line, ", " and ": ". A small model left free to choose its
# whitespace tends to spend its token budget on it.
_JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_ERROR_CHARS = 600


class LLGuidanceMatcher(GrammarMatcher):
    """Once llguidance's matcher is stopped (the grammar is complete and nothing may follow), its
    try_consume_tokens and validate_tokens refuse the end-of-sequence token, and consume_token
    takes it without recording it (a rollback would undo the token before it). That last token
    is kept here instead (`unrecorded_end`)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        super().__init__()
        self.ll = matcher
        self.eos_token_ids = eos_token_ids
        self.unrecorded_end = False
        self.ended = False  # the last accepted token ended the sequence

    def accept_tokens(self, tokens: list[int]) -> bool:
        if self.unrecorded_end:
            return not tokens  # nothing follows the end
        accepted = self.ll.try_consume_tokens(tokens)
        if accepted < len(tokens) and self._stopped_at_end(tokens[accepted]):
            self.ll.consume_token(tokens[accepted])
            self.unrecorded_end = True
            accepted += 1
        self.num_tokens += accepted
        self.ended = self.ended if not accepted else tokens[accepted - 1] in self.eos_token_ids
        return accepted == len(tokens)

    def validate_tokens(self, tokens: list[int]) -> int:
        if self.unrecorded_end:
            return 0
        valid = self.ll.validate_tokens(tokens)
        end = next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), len(tokens))
        if valid > end:
            return end + 1  # nothing follows the end
        if valid == end < len(tokens):
            stepped = self.ll.try_consume_tokens(tokens[:valid])  # step there, look, step back
            valid += self._stopped_at_end(tokens[valid])
            if stepped:
                self.ll.rollback(stepped)
        return valid

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens; only {self.num_tokens} were accepted")
        if num_tokens == 0:
            return
        self.num_tokens -= num_tokens
        self.ended = False  # nothing follows an end, so the token now last is not one
        recorded = num_tokens - self.unrecorded_end
        self.unrecorded_end = False
        if recorded and not self.ll.rollback(recorded):
            raise RuntimeError(f"llguidance refused to roll back {recorded} tokens: {self.ll.get_error()}")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self.ll.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def is_terminated(self) -> bool:
        return self.ended

    def error(self) -> str | None:
        return _short(self.ll.get_error()) if self.ll.is_error() else None

    def _stopped_at_end(self, token: int) -> bool:
        return token in self.eos_token_ids and self.ll.is_stopped() and not self.ll.is_error()


class LLGuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], strict_schemas: bool = True) -> None:
        self.strict_schemas = strict_schemas  # undeclared keys forbidden (strict_schema.py)
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        # Short error messages: the default puts the parser state and the whole grammar in them.
        # The library's default limits (lexer fuel per mask, items per parser row, lexer states)
        # bound the work of every mask; past them the matcher reports an error, which ends the
        # request with that error instead of letting it run on.
        self.limits = llguidance.LLParserLimits(verbose_errors=False)

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        if spec.kind == "json" and self.strict_schemas:
            spec = GrammarSpec(spec.kind, closed_schema_text(spec.text))
        grammar = _grammar_text(spec)
        # The compiled grammar is a matcher at the start; each request gets a deep copy.
        prototype = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if prototype.is_error():
            raise ValueError(_short(prototype.get_error()))
        return prototype

    def matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self.eos_token_ids)



def _grammar_text(spec: GrammarSpec) -> str:
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_FORMAT)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_FORMAT)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            return llguidance.grammar_from("choice", json.loads(spec.text))
        return llguidance.grammar_from("grammar", spec.text)  # GBNF/EBNF ("::=") or Lark
    except ValueError as e:
        raise ValueError(_short(str(e))) from None


def _short(message: str) -> str:
    # (Without verbose errors the library marks its messages with a tag that tells a reader nothing.)
    message = " ".join(message.replace("<non-verbose/>", "").split())
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + " ..."
