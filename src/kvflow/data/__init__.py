"""Data shipped with kvflow (no code): the English text that perplexity and AWQ calibration read."""

from __future__ import annotations

from importlib import resources

ENGLISH_TEXT = "kjv_genesis_ruth_luke.txt"


def english_text() -> str:
    return resources.files(__name__).joinpath(ENGLISH_TEXT).read_text(encoding="utf-8")
