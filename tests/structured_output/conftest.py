"""What the structured-output tests share: the default model's tokenizer (its GGUF metadata only,
no weights) and its end-of-sequence ids."""

from __future__ import annotations

import pytest

from kvflow.model.loader.resolve import load_checkpoint


@pytest.fixture(scope="session")
def tokenizer():
    return load_checkpoint(None, load_tokenizer=True, load_weights=False).tokenizer


@pytest.fixture(scope="session")
def eos_ids(tokenizer) -> list[int]:
    return sorted(tokenizer.eos_token_ids)
