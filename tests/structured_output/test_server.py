"""Structured output and tool calling through the OpenAI-compatible server, driven by the
official `openai` client at temperature 1 with the default model: response_format, vLLM's extra
fields, tool_choice required and named (streamed and not), and 400s for every constraint that
cannot compile — including one that takes too long — with the engine serving on afterwards."""

from __future__ import annotations

import json
import re

import jsonschema
import live_server
import openai
import pytest

from kvflow import EngineArgs

pytestmark = pytest.mark.slow
own_server = live_server.own_server

MODEL = "smol"
ASK = [{"role": "user", "content": "What is the weather like in Paris, in celsius?"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                       "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two small integers",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
    {"type": "function", "function": {"name": "now", "description": "The time now"}},  # no parameters
]
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "additionalProperties": False})
              for t in TOOLS}


@pytest.fixture(scope="module")
def client():
    with live_server.served_engine(EngineArgs(max_model_len=1024, kv_cache_memory_gb=0.25, disable_log_stats=True),
                                   MODEL) as (server, _):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", ASK), temperature=1.0,
                                          max_tokens=kwargs.pop("max_tokens", 80), **kwargs)


def streamed_choices(stream) -> dict[int, dict]:
    """index → {"content", "calls": {call index: {"id", "name", "arguments"}}, "finish_reason"}"""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            choice = choices.setdefault(c.index, {"content": "", "calls": {}, "finish_reason": None})
            choice["content"] += c.delta.content or ""
            choice["finish_reason"] = c.finish_reason or choice["finish_reason"]
            for d in c.delta.tool_calls or []:
                call = choice["calls"].setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                assert d.id is None or call["id"] == d.id
                call["arguments"] += d.function.arguments or ""
    return choices


def assert_valid_call(name: str, arguments: str) -> None:
    assert name in PARAMETERS
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    got = chat(client, response_format=fmt, n=2, seed=1)
    assert all(c.finish_reason == "stop" for c in got.choices)
    for c in got.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)
    for choice in streamed_choices(chat(client, response_format=fmt, n=2, seed=2, stream=True)).values():
        jsonschema.validate(json.loads(choice["content"]), PERSON)


def test_vllm_fields_on_chat_and_completions(client):
    cases = [({"guided_regex": r"[0-9]{2}:[0-9]{2}"}, lambda t: len(t) == 5 and t[2] == ":"),
             ({"guided_choice": ["sunny", "rainy"]}, lambda t: t in ("sunny", "rainy")),
             ({"structured_outputs": {"choice": ["hot", "cold"]}}, lambda t: t in ("hot", "cold")),
             ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
             ({"guided_grammar": 'root ::= "temp=" [0-9] [0-9]? "C"'}, lambda t: t.startswith("temp=") and t.endswith("C"))]
    for extra, ok in cases:
        got = chat(client, extra_body=extra, n=2, seed=3)
        assert all(ok(c.message.content) for c in got.choices), (extra, [c.message.content for c in got.choices])
        got = client.completions.create(model=MODEL, prompt="Weather report:", max_tokens=60, temperature=1.0,
                                        seed=4, extra_body=extra)
        assert ok(got.choices[0].text), (extra, got.choices[0].text)


def test_tool_choice_required(client):
    got = chat(client, tools=TOOLS, tool_choice="required", n=3, seed=5)
    # "required" allows a list of calls: a sampled list may run into max_tokens, and then the calls
    # it completed are still returned, each valid.
    assert any(c.finish_reason == "tool_calls" for c in got.choices)
    for c in got.choices:
        assert c.finish_reason in ("tool_calls", "length") and c.message.content is None and c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            assert_valid_call(call.function.name, call.function.arguments)
    streamed = streamed_choices(chat(client, tools=TOOLS, tool_choice="required", n=2, seed=6, stream=True))
    assert sorted(streamed) == [0, 1]
    for choice in streamed.values():
        assert choice["finish_reason"] in ("tool_calls", "length") and choice["calls"] and not choice["content"].strip()
        for call in choice["calls"].values():
            assert call["id"].startswith("call_")
            assert_valid_call(call["name"], call["arguments"])


def test_tool_choice_required_without_parallel_calls_makes_one(client):
    got = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=3, seed=7)
    assert all(len(c.message.tool_calls) == 1 for c in got.choices)


def test_named_function(client):
    choice = {"type": "function", "function": {"name": "add"}}
    got = chat(client, tools=TOOLS, tool_choice=choice, n=2, seed=8)
    for c in got.choices:
        [call] = c.message.tool_calls
        # The call the request named is the answer it asked for: "stop", as OpenAI and vLLM say.
        assert call.function.name == "add" and c.finish_reason == "stop"
        assert_valid_call("add", call.function.arguments)
    for streamed in streamed_choices(chat(client, tools=TOOLS, tool_choice=choice, seed=9, stream=True)).values():
        [call] = streamed["calls"].values()  # arguments arrive in pieces, under one id
        assert call["name"] == "add" and streamed["finish_reason"] == "stop"
        assert_valid_call("add", call["arguments"])


# A schema as langchain's bind_tools and pydantic write it: properties named, additionalProperties
# left out (JSON Schema's default: other keys allowed).
OPEN_WEATHER = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_named_tool_with_an_open_schema_always_parses(client, temperature):
    """Keys the schema does not declare are forbidden by default (vLLM's strict default), so the
    model cannot add key after key until max_tokens: at temperature 0 the arguments parse and hold
    only `city`; at 1 the small model may still ramble inside the city's string until max_tokens,
    but never past it into another key."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": OPEN_WEATHER}}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    got = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice, n=4,
                                         temperature=temperature, seed=11, max_tokens=64)
    for c in got.choices:
        [call] = c.message.tool_calls
        if temperature == 0 or c.finish_reason == "stop":
            assert c.finish_reason == "stop" and set(json.loads(call.function.arguments)) == {"city"}
        else:  # cut inside the one string the schema allows
            assert c.finish_reason == "length" and re.fullmatch(r'\{"city": "([^"\\]|\\.)*', call.function.arguments)


def test_tools_reach_the_prompt_and_past_calls_are_accepted(client):
    plain = chat(client, max_tokens=1).usage.prompt_tokens
    assert chat(client, tools=TOOLS, max_tokens=1).usage.prompt_tokens > plain + 50  # auto: described
    assert chat(client, tools=TOOLS, tool_choice="none", max_tokens=1).usage.prompt_tokens == plain
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    got = chat(client, messages=history, tools=TOOLS, max_tokens=8)
    assert got.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert got.usage.prompt_tokens > plain + 50


@pytest.mark.parametrize("kwargs, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "the JSON schema is invalid or unsupported"),
    ({"extra_body": {"guided_json": {"type": "object", "not": {"required": ["a"]}}}}, "unsupported.*not"),
    ({"extra_body": {"guided_regex": "[a-"}}, "the regex is invalid or unsupported"),
    ({"extra_body": {"guided_grammar": "root ::= ( undefined"}}, "the grammar is invalid or unsupported"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "give at most one of guided_regex, guided_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "'fly', which is not in tools"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined with response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_what_cannot_compile_or_combine_is_a_400(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, max_tokens=4, **kwargs)
    assert error.value.status_code == 400
    assert re.search(message, error.value.body["message"]), error.value.body
    assert chat(client, max_tokens=2).choices[0].message.content is not None  # the engine serves on


def test_a_schema_too_slow_to_compile_is_a_400(own_server):
    server = own_server(["--structured-outputs-compile-timeout", "0.001", "--max-model-len", "512",
                         "--kv-cache-memory-gb", "0.1", "--served-model-name", MODEL])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="did not compile within 0.001 s"):
        chat(client, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert chat(client, max_tokens=2).choices[0].finish_reason in ("length", "stop")  # it serves on
