"""`kvflow eval passkey` on the default model: the key is where the prompt says, the full cache
finds it, and a sink-and-window budget that evicted it does not (the question eviction raises)."""

from __future__ import annotations

import pytest

from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.eval.passkey import passkey, passkey_prompt


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineArgs(disable_log_stats=True, num_kv_blocks=256))


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_the_key_sits_at_its_depth_of_a_prompt_of_the_length_asked(engine, depth):
    tokenizer = engine.get_tokenizer()
    ids = passkey_prompt(tokenizer, 1024, depth, 12345)
    assert 1000 <= len(ids) <= 1024
    text = tokenizer.decode(ids)
    at = text.index("The pass key is 12345.") / len(text)
    assert abs(at - depth) < 0.05 and text.endswith("What is the pass key? The pass key is")


def test_the_full_cache_finds_a_key_a_sink_window_budget_evicted(engine):
    assert passkey(engine, [1024], [0.5], trials=1).found == [[1.0]]
    evicting = LLMEngine(EngineArgs(disable_log_stats=True, num_kv_blocks=256, kv_eviction_policy="sink_window",
                                    kv_budget_tokens=256))
    assert passkey(evicting, [1024], [0.5], trials=1).found == [[0.0]]
