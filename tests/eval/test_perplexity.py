"""`kvflow eval ppl` against transformers' loss on the same windows of the shipped text."""

from __future__ import annotations

import math

import torch
from tiny_models import make_tiny_model

from kvflow.config import EngineArgs
from kvflow.data import english_text
from kvflow.engine.llm_engine import LLMEngine
from kvflow.eval.perplexity import perplexity


def _char_tokenizer(directory) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:'!?-\n"
    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(directory / "tokenizer.json"))


def test_shipped_text_is_a_few_hundred_kb_of_english():
    text = english_text()
    assert 300_000 < len(text.encode()) < 400_000 and text.startswith("Genesis 1\n\nIn the beginning God")


def test_perplexity_matches_transformers_loss(tmp_path):
    hf = make_tiny_model("llama-gqa-llama3-rope", tmp_path)
    _char_tokenizer(tmp_path)
    engine = LLMEngine(EngineArgs(model=str(tmp_path), dtype="float32", disable_log_stats=True))
    result = perplexity(engine, max_tokens=300, context=64, progress=False)
    ids = engine.get_tokenizer().encode(english_text(), add_special_tokens=False)[:300]
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, 300, 64):
            window = torch.tensor([ids[i:i + 64]])
            loss = hf(window, labels=window).loss.item()  # mean over the window's tokens but the first
            total += loss * (window.shape[1] - 1)
            count += window.shape[1] - 1
    assert result.tokens == count == 300 - 5 and result.windows == 5
    assert math.isclose(result.nll, total / count, rel_tol=1e-4)
    assert math.isclose(result.perplexity, math.exp(total / count), rel_tol=1e-4)
