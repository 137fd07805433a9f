"""A SentencePiece BPE tokenizer (`tokenizer.ggml.model == "llama"`: Llama 1/2, Gemma) rebuilt from
the GGUF vocabulary and its scores.

SentencePiece's BPE grows a word by repeatedly merging the adjacent pair whose merged piece has
the highest score. A GGUF keeps the pieces and scores but not the merges, so they are recovered:
every way of splitting a piece into two pieces of the vocabulary is a merge, ranked by the merged
piece's score. Spaces are spelled "▁"; characters outside the vocabulary fall back to byte pieces
<0xNN>. Gemma's GGUF spells its pieces made only of spaces with real spaces; they are respelled.
"""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, normalizers

SPACE = "\u2581"
_NORMAL, _UNKNOWN, _BYTE = 1, 2, 6  # llama.cpp token types


def respell(tokens: list[str], token_types: list[int]) -> tuple[list[str], list[int]]:
    """Pieces made only of spaces, stored as real spaces (and as user-defined tokens), become runs
    of "▁" and ordinary pieces, which BPE can build from "▁"."""
    pieces, kinds = list(tokens), list(token_types)
    for i, token in enumerate(tokens):
        if token and token.strip(" ") == "":
            pieces[i], kinds[i] = SPACE * len(token), _NORMAL
    return pieces, kinds


def sentencepiece_backend(pieces: list[str], token_types: list[int], scores: list[float], add_space_prefix: bool,
                          rank_by_position: bool) -> tokenizers.Tokenizer:
    """`pieces`/`token_types` as `respell` returns them. Merges rank by the merged piece's score,
    or, where the scores do not follow the merge order (Gemma), by its position in the file."""
    if len(scores) != len(pieces):
        raise ValueError(f"GGUF tokenizer has {len(pieces)} tokens but {len(scores)} scores")
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)
    ranks = [i for i in range(len(pieces))] if rank_by_position else [-s for s in scores]
    unknown = next((p for p, kind in zip(pieces, token_types) if kind == _UNKNOWN), None)
    model = models.BPE(vocab=vocab, merges=_merges(pieces, token_types, ranks, vocab), unk_token=unknown,
                       byte_fallback=True, fuse_unk=True)
    backend = tokenizers.Tokenizer(model)
    spaces = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*spaces, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return backend


def _merges(pieces: list[str], token_types: list[int], ranks: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    ranked = []
    for piece, kind, rank in zip(pieces, token_types, ranks):
        if kind != _NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((rank, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
