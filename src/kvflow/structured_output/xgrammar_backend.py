"""The optional backend: xgrammar (pip install xgrammar; it needs transformers).

xgrammar compiles ahead: it precomputes, per grammar state, which tokens are surely allowed or
refused, so its masks are the fastest to fill but its compiles are the slowest (seconds for a
schema with many long bounded strings). Compilation releases the GIL.
"""

from __future__ import annotations

import json

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from kvflow.structured_output.backend import GrammarBackend, GrammarMatcher
from kvflow.structured_output.params import GrammarSpec


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        super().__init__()
        self.xg = matcher

    def accept_tokens(self, tokens: list[int]) -> bool:
        accepted = self._advance(tokens)
        self.num_tokens += accepted
        return accepted == len(tokens)

    def validate_tokens(self, tokens: list[int]) -> int:
        accepted = self._advance(tokens)
        if accepted:
            self.xg.rollback(accepted)
        return accepted

    def _advance(self, tokens: list[int]) -> int:
        for accepted, token in enumerate(tokens):
            # (xgrammar logs a warning for a token offered after the end.)
            if self.xg.is_terminated() or not self.xg.accept_token(token):
                return accepted
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens; only {self.num_tokens} were accepted")
        if num_tokens:
            self.xg.rollback(num_tokens)
        self.num_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.xg.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.xg.is_terminated()


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], strict_schemas: bool = True) -> None:
        self.strict_schemas = strict_schemas  # xgrammar's strict_mode: undeclared keys forbidden
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer),
                                                  vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self.vocab_size = vocab_size
        # Our compiler caches by spec already, with its own bound.
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            return self._compile(spec)
        except (RuntimeError, ValueError) as e:  # xgrammar's parse errors subclass RuntimeError
            raise ValueError(str(e).strip()) from None

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind in ("json", "json_object"):
            # One line, ", " and ": ", as the guidance backend writes JSON.
            schema = spec.text if spec.kind == "json" else '{"type": "object"}'
            return self.compiler.compile_json_schema(schema, any_whitespace=False,
                                                     strict_mode=self.strict_schemas or spec.kind == "json_object")
        if spec.kind == "regex":
            return self.compiler.compile_regex(spec.text)
        if spec.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(spec.text))
            return self.compiler.compile_grammar(f"root ::= {alternatives}")
        if "::=" in spec.text:
            return self.compiler.compile_grammar(spec.text)
        return self.compiler.compile_lark(spec.text)

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))
