"""A completion the engine ends with finish_reason "error" (its structured-output constraint had
no valid continuation, or the grammar library gave up: CompletionOutput.error says which) is no
success (issue 39): non-streaming, the request is a 400 `structured_output_failed` carrying the
engine's message; streaming, what was sent stays sent, then an error event in the shape of every
mid-stream error and [DONE], and no choice ever finishes "stop" or "tool_calls". The engine's
outputs are edited in this process: the tiny model's tokenizer takes no grammar."""

from __future__ import annotations

import json

import httpx
import pytest
from live_server import edit_finished_outputs, start_thread, wait_until
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow import EngineArgs, LLMEngine
from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.openai.api_server import build_app

C, P = "/v1/chat/completions", "/v1/completions"
WHY = "the grammar allows no token after 'tru'"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
BODIES = {
    "chat": (C, {"messages": [{"role": "user", "content": "x"}]}),
    "chat, n=2": (C, {"messages": [{"role": "user", "content": "x"}], "n": 2}),
    "chat, tools auto": (C, {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}),
    "completions, two prompts": (P, {"prompt": ["x", "y"]}),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    make_tiny_model("llama-gqa-llama3-rope", path)
    write_tiny_tokenizer(path)
    return LLMEngine(EngineArgs(str(path), dtype="float32", disable_log_stats=True))


@pytest.fixture(scope="module")
def served(engine):
    llm = AsyncLLM(engine)
    live = start_thread(build_app(llm, "tiny"))
    with httpx.Client(base_url=live.url, timeout=120) as client:
        yield llm, client
    live.stop()
    llm.shutdown()


def fail_first(engine, monkeypatch) -> None:
    """The first completion to finish ends with the engine's error; later ones finish normally."""
    failed = []

    def edit(completion) -> None:
        if not failed:
            failed.append(completion)
            completion.finish_reason, completion.error = "error", WHY

    edit_finished_outputs(monkeypatch, engine, edit)


def assert_structured_output_error(error: dict) -> None:
    assert error["code"] == "structured_output_failed" and error["type"] == "invalid_request_error"
    assert WHY in error["message"]


@pytest.mark.parametrize("name", BODIES)
def test_a_failed_completion_makes_the_whole_answer_a_400(served, engine, monkeypatch, name):
    llm, http = served
    fail_first(engine, monkeypatch)
    path, body = BODIES[name]
    response = http.post(path, json={**body, "max_tokens": 6, "ignore_eos": True})
    assert response.status_code == 400, response.text
    assert_structured_output_error(response.json()["error"])
    assert wait_until(lambda: llm.get_stats().num_running == 0 and llm.get_stats().kv_cache_usage == 0, 10)


@pytest.mark.parametrize("name", BODIES)
def test_a_failed_completion_ends_its_stream_with_an_error_event(served, engine, monkeypatch, name):
    llm, http = served
    fail_first(engine, monkeypatch)
    path, body = BODIES[name]
    with http.stream("POST", path, json={**body, "max_tokens": 6, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert_structured_output_error(json.loads(events[-2])["error"])
    choices = [c for e in events[:-2] for c in json.loads(e)["choices"]]
    assert any(c.get("text") or c.get("delta", {}).get("content") for c in choices)  # sent before the failure
    reasons = [c.get("finish_reason") for c in choices]
    assert not {"stop", "tool_calls", "error"} & set(reasons), reasons
    assert wait_until(lambda: llm.get_stats().num_running == 0 and llm.get_stats().kv_cache_usage == 0, 10)


def test_outputs_that_finish_normally_are_unchanged(served):
    _, http = served
    response = http.post(P, json={"prompt": "x", "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
