"""JSON nested as deep as a client likes is never a 500 (issue 39): JSON inside a string field (a
past tool call's arguments, a schema given as text) deeper than MAX_JSON_DEPTH is a 400 naming the
field; a body of nothing but `[` is a 400; a model's `<tool_call>` text nested too deep to parse
is content, as any block that does not parse. A tiny model served in this process."""

from __future__ import annotations

import json

import httpx
import pytest
from live_server import edit_finished_outputs, start_thread
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow import EngineArgs, LLMEngine
from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.openai.api_server import build_app
from kvflow.entrypoints.openai.json_depth import MAX_JSON_DEPTH, json_depth
from kvflow.entrypoints.openai.limits import MIB
from kvflow.entrypoints.openai.tool_parsers import choice_output

C, P = "/v1/chat/completions", "/v1/completions"
DEEP = "[" * 5000 + "]" * 5000
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def past_call(arguments: str) -> dict:
    return {"messages": [{"role": "user", "content": "x"},
                         {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                               "function": {"name": "lookup", "arguments": arguments}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "ok"}],
            "max_tokens": 1}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    make_tiny_model("llama-gqa-llama3-rope", path)
    write_tiny_tokenizer(path)
    return LLMEngine(EngineArgs(str(path), dtype="float32", disable_log_stats=True))


@pytest.fixture(scope="module")
def http(engine):
    llm = AsyncLLM(engine)
    live = start_thread(build_app(llm, "tiny"))
    with httpx.Client(base_url=live.url, timeout=120) as client:
        yield client
    live.stop()
    llm.shutdown()


def assert_400(response: httpx.Response, param: str | None, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error


def test_depth_is_measured_without_parsing():
    assert json_depth(nested(3)) == 3 and json_depth('{"a": [1, {"b": 2}]}') == 3 and json_depth("1") == 0
    assert json_depth('["[[[", {"k": "\\"[{"}]') == 2  # brackets inside strings do not nest
    assert json_depth('{"cut off": "[[[') == 1 and json_depth("[[é, ü") == 2  # not JSON: still measured


def test_a_past_tool_calls_deep_arguments_are_a_400_naming_them(http):
    assert http.post(C, json=past_call(nested(MAX_JSON_DEPTH))).status_code == 200
    for arguments in (nested(MAX_JSON_DEPTH + 1), DEEP, "[" * 5000):
        assert_400(http.post(C, json=past_call(arguments)), "messages.1.tool_calls.0.function.arguments",
                   f"at most {MAX_JSON_DEPTH} levels")
    assert http.post(C, json=past_call("not JSON at all")).status_code == 200  # passed on as the text it is


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_a_schema_given_as_deep_text_is_a_400_naming_it(http, field):
    value = DEEP if field == "guided_json" else {"json": DEEP}
    param = "guided_json" if field == "guided_json" else "structured_outputs.json"
    for path, body in ((P, {"prompt": "x"}), (C, {"messages": [{"role": "user", "content": "x"}]})):
        assert_400(http.post(path, json={**body, field: value}), param, "5000 levels deep")


def test_a_body_of_nothing_but_brackets_is_a_400(http):
    for body in (b"[" * (2 * MIB), b'{"prompt": ' + b"[" * 100_000 + b"}"):
        response = http.post(P, content=body, headers={"Content-Type": "application/json"})
        assert_400(response, None, "not valid JSON")


@pytest.mark.parametrize("stream", [False, True])
def test_a_models_tool_call_too_deep_to_parse_is_content(http, engine, monkeypatch, stream):
    text = f"<tool_call>\n{DEEP}\n</tool_call>"
    edit_finished_outputs(monkeypatch, engine, lambda completion: setattr(completion, "text", text))
    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "auto", "max_tokens": 1,
            "stream": stream}
    response = http.post(C, json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        deltas = [c["delta"] for e in events[:-1] for c in json.loads(e)["choices"]]
        content, calls = "".join(d.get("content") or "" for d in deltas), [d for d in deltas if d.get("tool_calls")]
    else:
        message = response.json()["choices"][0]["message"]
        content, calls = message["content"], message["tool_calls"]
    assert content == text and not calls


def test_forced_calls_too_deep_to_parse_are_not_calls():
    output = choice_output("required", "hermes")
    assert output.feed('[{"name": "lookup", "arguments": {}}, {"name": "lookup", "arguments": ', final=False)[1]
    assert output.feed(DEEP + "}]", final=True) == ("", [])
    assert output.num_calls == 1
