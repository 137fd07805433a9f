"""The engine is built on a thread of its own that then ends (engine_thread.build_on_fresh_thread),
so that the thread that serves HTTP never opens an OpenMP team: with more OpenMP workers than
cores, libgomp stops letting them spin, and each of a step's parallel regions on the engine thread
waited for a wake-up (served decode steps 45 ms against 30 offline)."""

from __future__ import annotations

import threading

import pytest
from tiny_models import make_tiny_model

from kvflow.config import EngineArgs
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.engine_thread import build_on_fresh_thread
from kvflow.engine.llm_engine import LLMEngine
from kvflow.entrypoints.openai.api_server import _start_engine
from kvflow.entrypoints.openai.limits import ServerLimits


def test_build_on_fresh_thread_returns_or_raises_what_the_build_did():
    caller = threading.current_thread()
    ran_on = build_on_fresh_thread(threading.current_thread)
    assert ran_on is not caller and not ran_on.is_alive()

    def fails():
        raise ValueError("max_model_len: too large")

    with pytest.raises(ValueError, match="max_model_len: too large"):
        build_on_fresh_thread(fails)


@pytest.mark.parametrize("start", ["async_llm", "server"])
def test_the_served_engine_is_built_off_the_serving_thread(start, tmp_path, monkeypatch):
    make_tiny_model("llama-mha-tied", tmp_path)
    built_on = []
    original = LLMEngine.__init__

    def recording(self, *args, **kwargs):
        built_on.append(threading.current_thread())
        original(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "__init__", recording)
    args = EngineArgs(str(tmp_path), skip_tokenizer_init=True, disable_log_stats=True)
    llm = AsyncLLM.from_engine_args(args) if start == "async_llm" else _start_engine(args, ServerLimits(), [])
    try:
        assert built_on and built_on[0] is not threading.current_thread() and not built_on[0].is_alive()
    finally:
        llm.shutdown()
