"""Incremental detokenization and stop strings.

Text is released only once it is stable: a byte-level BPE token can end in the middle of a UTF-8
character, which decodes to U+FFFD until the next token completes it, so such text is held back.
Each step decodes only a short window (the tokens since the last release), never the whole
output. The concatenation of all releases equals decoding the output token ids at once.
"""

from __future__ import annotations

from kvflow.model.tokenizer import Tokenizer
from kvflow.sampling_params import SamplingParams

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start: tokens already released, kept as decoding context
        self._read_offset = 0  # tokens before this were released

    def append(self, token_ids: list[int], final: bool) -> str | None:
        """Add tokens; returns the stop string if one ended the text (which is then cut there)."""
        self.ids.extend(token_ids)
        before = len(self.text)
        self.text += self._release(final)
        return self._find_stop(before) if self.stop else None

    def _release(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        window = decode(self.ids[self._prefix_offset:], self.skip_special_tokens)
        if window.endswith(_INCOMPLETE) and not final:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return window[len(prefix):]

    def _find_stop(self, before: int) -> str | None:
        # Only text that could contain a new match: the new part plus a stop-string's length.
        start = max(0, before - max(len(s) for s in self.stop) + 1)
        hits = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index + len(stop) if self.include_stop else index]
        return stop
