"""A cheap lower bound on a text's token count, to refuse a hopelessly long prompt before
tokenizing it (tokenizing megabytes takes seconds).

If no token of the vocabulary covers more than L bytes of input, a text of B bytes has at least
B / L tokens, so a text longer than `max_tokens * L` bytes cannot fit in `max_tokens`. That
holds when every token decodes to exactly the input it covers: BPE tokenizers that are byte-level
(GPT-2, Llama 3, Qwen, SmolLM) or SentencePiece-style (whose only normalizing is the space marker),
with no unknown token that may swallow a run of characters. For any other tokenizer (Unicode
normalization, WordPiece, Unigram) there is no bound, and the prompt is tokenized to be measured.
"""

from __future__ import annotations

import json

from kvflow.model.tokenizer import Tokenizer

_HARMLESS_NORMALIZERS = {"Prepend", "Replace"}  # SentencePiece's space marker: no text shrinks


def longest_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most input bytes one token can cover, or None if this tokenizer has no such bound."""
    spec = json.loads(tokenizer.backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None  # one unknown token may stand for any run of unknown characters
    if not _normalizers(spec.get("normalizer")) <= _HARMLESS_NORMALIZERS:
        return None
    return max(len(tokenizer.decode([i]).encode("utf-8")) for i in range(tokenizer.vocab_size))


def _normalizers(spec: dict | None) -> set[str]:
    if spec is None:
        return set()
    if spec.get("type") == "Sequence":
        return set().union(*(_normalizers(s) for s in spec.get("normalizers", [])))
    return {spec.get("type", "?")}
