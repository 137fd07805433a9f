"""Rebuild a `tokenizers.Tokenizer` from the tokenizer metadata inside a GGUF file.

A GGUF carries no tokenizer.json, only llama.cpp's description of it: the token list, the merges,
a type per token, special token ids and the name of a pre-tokenizer (`tokenizer.ggml.pre`). We turn
that back into the pipeline HF would run: pre-tokenizer -> byte-level BPE -> optional BOS/EOS.

Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE) and `"llama"` (SentencePiece BPE,
`kvflow.model.gguf_sentencepiece`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from kvflow.model.gguf_sentencepiece import respell, sentencepiece_backend
from kvflow.model.tokenizer import Tokenizer, TokenizerMeta

logger = logging.getLogger(__name__)

# llama.cpp's token types (enum llama_token_type in the GGUF spec).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Pre-tokenizer splits, keyed by the names llama.cpp writes to `tokenizer.ggml.pre`. The GPT-2
# split is the one built into ByteLevel(use_regex=True); the others are the models' own patterns.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = {"gpt2", "default", "mpt", "olmo", "jais", "trillion"}
# These first isolate every digit, then apply the GPT-2 split (SmolLM/StarCoder-family vocabularies
# were trained on single digits).
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}


def tokenizer_from_gguf(reader_or_fields: Any) -> Tokenizer:
    """Build the tokenizer a GGUF describes.

    `reader_or_fields` is a `gguf.GGUFReader`, or a mapping from metadata key to either a
    `gguf.ReaderField` or a plain Python value (handy for tests).
    """
    meta = _MetadataView(reader_or_fields)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise ValueError("the GGUF file has no tokenizer metadata (tokenizer.ggml.model is missing)")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported yet; only byte-level BPE ('gpt2') and "
            "SentencePiece ('llama') are. Load this model from an HF directory with tokenizer.json instead."
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"GGUF tokenizer has {len(tokens)} tokens but {len(token_types)} token types")
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    ids = _special_ids(meta, len(tokens))
    texts = {name: (tokens[i] if i is not None else None) for name, i in ids.items()}

    if kind == "llama":
        tokens, token_types = respell(tokens, token_types)
        gemma = str(meta.get("general.architecture", "")).startswith("gemma")
        backend = sentencepiece_backend(tokens, token_types, meta.require("tokenizer.ggml.scores"),
                                        bool(meta.get("tokenizer.ggml.add_space_prefix", True)), rank_by_position=gemma)
    else:
        backend = tokenizers.Tokenizer(_bpe_model(tokens, token_types, merges, meta.get("tokenizer.ggml.pre")))
        _configure_pipeline(backend, meta.get("tokenizer.ggml.pre"))
    _add_special_tokens(backend, tokens, token_types, special_ids={i for i in ids.values() if i is not None})
    backend.post_processor = _post_processor(
        bos=(texts["bos"], ids["bos"]) if meta.get("tokenizer.ggml.add_bos_token", False) else None,
        eos=(texts["eos"], ids["eos"]) if meta.get("tokenizer.ggml.add_eos_token", False) else None,
    )
    # llama.cpp also stops on end-of-turn / end-of-message tokens, so they join EOS.
    stop_ids = tuple(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None)
    return Tokenizer(
        backend,
        TokenizerMeta(
            bos_token=texts["bos"],
            eos_token=texts["eos"],
            pad_token=texts["pad"],
            unk_token=texts["unk"],
            chat_template=meta.get("tokenizer.chat_template"),
            eos_token_ids=tuple(dict.fromkeys(stop_ids)),
        ),
    )


class _MetadataView:
    """Uniform access to GGUF metadata whether it comes as ReaderFields or plain values."""

    def __init__(self, source: Any) -> None:
        self._fields: Mapping[str, Any] = source.fields if hasattr(source, "fields") else source

    def get(self, key: str, default: Any = None) -> Any:
        value = self._fields.get(key)
        if value is None:
            return default
        return value.contents() if hasattr(value, "contents") else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"the GGUF tokenizer metadata lacks {key!r}")
        return value


def _special_ids(meta: _MetadataView, n_tokens: int) -> dict[str, int | None]:
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id", "eom": "eom_token_id",
            "pad": "padding_token_id", "unk": "unknown_token_id"}
    ids: dict[str, int | None] = {}
    for name, key in keys.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and not 0 <= int(i) < n_tokens:
            raise ValueError(f"tokenizer.ggml.{key} = {i} is outside the vocabulary of {n_tokens} tokens")
        ids[name] = None if i is None else int(i)
    return ids


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character spelling used in byte-level vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _bpe_model(tokens: list[str], token_types: list[int], merges: list[str], pre: str | None) -> models.BPE:
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, token_types, strict=True)):
        # A normal token spelled in raw text (not the byte alphabet) could never be produced by BPE;
        # respell it so it can, unless that would collide with another token.
        if kind == _NORMAL and not set(tok) <= alphabet:
            respelled = "".join(spelling[b] for b in tok.encode("utf-8"))
            tok = tok if respelled in vocab else respelled
        vocab.setdefault(tok, i)
    pairs = [_split_merge(m) for m in merges]
    # Llama 3's tokenizer takes a whole pre-token straight from the vocabulary when it is there.
    return models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_PRE)


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ValueError(f"malformed GGUF merge {merge!r}: expected two tokens separated by a space")
    return left, right


def _configure_pipeline(backend: tokenizers.Tokenizer, pre: str | None) -> None:
    backend.decoder = decoders.ByteLevel()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre is None or pre in _GPT2_PRE:
        backend.pre_tokenizer = byte_level
    elif pre in _DIGITS_THEN_GPT2_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
        )
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if pre in _QWEN2_PRE:
            backend.normalizer = normalizers.NFC()  # as Qwen2's own tokenizer.json
    else:
        logger.warning("unknown GGUF pre-tokenizer %r; using the GPT-2 split, which may tokenize differently", pre)
        backend.pre_tokenizer = byte_level


def _add_special_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int], special_ids: set[int]
) -> None:
    # Control tokens (and the named BOS/EOS/PAD/UNK) must match whole in the text and decode as
    # special; user-defined tokens match whole but are ordinary text.
    special = [
        AddedToken(tok, special=True, normalized=False)
        for i, (tok, kind) in enumerate(zip(tokens, token_types))
        if kind == _CONTROL or i in special_ids
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, token_types)
        if kind == _USER_DEFINED
    ]
    before = backend.get_vocab_size(with_added_tokens=True)
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    if backend.get_vocab_size(with_added_tokens=True) != before:
        raise ValueError("GGUF special/added tokens are missing from the BPE vocabulary (duplicate token texts?)")


def _post_processor(bos: tuple[str | None, int | None] | None, eos: tuple[str | None, int | None] | None):
    """Prepend BOS / append EOS when the GGUF asks for it; None leaves the ids untouched."""
    marks = [m for m in (bos, eos) if m is not None]
    if not marks:
        return None
    for text, i in marks:
        if text is None or i is None:
            raise ValueError("the GGUF asks to add a BOS/EOS token but does not say which token it is")
    head = [bos[0]] if bos else []
    tail = [eos[0]] if eos else []
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *head, "$B:1", *tail],
        special_tokens=[(text, i) for text, i in marks],
    )
