"""Incremental detokenization with the default model's real tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest
import torch

from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.model.default_model import default_model_path
from kvflow.model.gguf_tokenizer import tokenizer_from_gguf
from kvflow.model.loader.gguf import open_gguf
from kvflow.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizer_from_gguf(open_gguf(default_model_path()))


def _stream(tokenizer, ids, params=None):
    detok = IncrementalDetokenizer(tokenizer, params or SamplingParams())
    pieces, stop = [], None
    for i, tid in enumerate(ids):
        before = len(detok.text)
        stop = detok.append([tid], final=i == len(ids) - 1)
        pieces.append(detok.text[before:])
        if stop:
            break
    return pieces, detok, stop


TEXTS = ["Hello, world! ", "naïve café — déjà vu", "日本語のテキストです。", "emoji 🎉🚀 mixed 中文 text",
         "def f(x):\n    return x * 2\n", "  leading spaces\tand tabs", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.parametrize("text", TEXTS)
def test_concatenated_deltas_equal_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, detok, _ = _stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)  # no broken UTF-8 ever released


def test_random_token_streams_round_trip(tokenizer):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, tokenizer.vocab_size, (40,), generator=gen).tolist()
        pieces, _, _ = _stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))
        assert "".join(pieces) == tokenizer.decode(ids)


def test_multibyte_character_split_across_tokens_is_held_back(tokenizer):
    # Byte-level tokens for one emoji: no piece may show half of it.
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    pieces, _, _ = _stream(tokenizer, ids)
    assert "".join(pieces) == "🎉"
    assert all(p in ("", "🎉") for p in pieces)


def test_stop_string_spanning_tokens_ends_text_exactly(tokenizer):
    text = "The answer is forty-two. Goodbye now."
    ids = tokenizer.encode(text, add_special_tokens=False)
    _, detok, stop = _stream(tokenizer, ids, SamplingParams(stop=["two. Good"]))
    assert stop == "two. Good"
    assert detok.text == "The answer is forty-"
    _, detok, _ = _stream(tokenizer, ids, SamplingParams(stop=["two. Good"], include_stop_str_in_output=True))
    assert detok.text == "The answer is forty-two. Good"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    _, detok, stop = _stream(tokenizer, ids, SamplingParams(stop=["delta", "beta"]))
    assert (stop, detok.text) == ("beta", "alpha ")
