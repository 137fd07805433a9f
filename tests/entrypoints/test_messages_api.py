"""POST /v1/messages (Anthropic's Messages API) through the official `anthropic` client on an
in-process server with the default model: text with a system prompt, the same tokens as chat
completions, stop sequences, streaming, tool_use and tool_result, errors in the API's shape, and
the key in `x-api-key`."""

from __future__ import annotations

import anthropic
import live_server
import openai
import pytest

from kvflow import AsyncLLM, EngineArgs
from kvflow.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.slow
MODEL = "smol"
ASK = "What is the capital of France?"
GREEDY = {"extra_body": {"temperature": 0}}  # this anthropic client has no temperature argument
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLM.from_engine_args(EngineArgs(max_model_len=1024, kv_cache_memory_gb=0.1, disable_log_stats=True,
                                                  enable_prefix_caching=False))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    server = live_server.start_thread(build_app(engine, MODEL))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_text_with_a_system_prompt_gives_chats_tokens(client, chat):
    msg = client.messages.create(model=MODEL, max_tokens=16, **GREEDY, system="Be brief.",
                                 messages=_user(ASK))
    same = chat.chat.completions.create(model=MODEL, max_tokens=16, **GREEDY, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].text == same.choices[0].message.content
    assert msg.usage.input_tokens == same.usage.prompt_tokens and msg.usage.output_tokens == same.usage.completion_tokens
    assert msg.stop_reason == ("max_tokens" if same.choices[0].finish_reason == "length" else "end_turn")


def test_a_stop_sequence_is_named(client):
    text = client.messages.create(model=MODEL, max_tokens=16, **GREEDY, messages=_user(ASK)).content[0].text
    word = text.split()[1]
    msg = client.messages.create(model=MODEL, max_tokens=16, **GREEDY, messages=_user(ASK), stop_sequences=[word])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == word and word not in msg.content[0].text


def test_the_stream_is_the_apis_events_and_adds_up(client):
    whole = client.messages.create(model=MODEL, max_tokens=12, **GREEDY, messages=_user(ASK))
    events = list(client.messages.create(model=MODEL, max_tokens=12, **GREEDY, messages=_user(ASK), stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ["content_block_stop",
                                                                                     "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason and events[-2].usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(model=MODEL, max_tokens=12, **GREEDY, messages=_user(ASK)) as stream:
        assert stream.get_final_message().content[0].text == whole.content[0].text


def test_tool_use_and_its_result(client):
    ask = _user("What is the weather in Paris?")
    msg = client.messages.create(model=MODEL, max_tokens=40, **GREEDY, messages=ask, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    [use] = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and use.name == "get_weather" and set(use.input) == {"city"}
    follow = ask + [{"role": "assistant", "content": [use.model_dump()]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=12, **GREEDY, messages=follow, tools=[WEATHER])
    assert answer.content and answer.usage.input_tokens > msg.usage.input_tokens
    events = list(client.messages.create(model=MODEL, max_tokens=40, **GREEDY, messages=ask, tools=[WEATHER],
                                         tool_choice={"type": "tool", "name": "get_weather"}, stream=True))
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert __import__("json").loads(partial) == use.input


@pytest.mark.parametrize(("block", "says"), [
    ({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hi"}},
     "blocks of type 'document' are not supported"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}, "reads text only"),
    ({"type": "image", "source": {"type": "file", "file_id": "file-1"}}, "source must be"),
])
def test_what_it_cannot_do_is_an_error_in_the_apis_shape(client, block, says):
    """A document block; an image for a model that reads no images (or that is no image); an
    image by file id: each an invalid_request_error naming what it refused."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [block]}])
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert says in caught.value.body["error"]["message"], caught.value.body


def test_the_key_comes_in_x_api_key(engine):
    server = live_server.start_thread(build_app(engine, MODEL, api_key="k"))
    try:
        good = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
        assert good.messages.create(model=MODEL, max_tokens=2, messages=_user("Hi")).content
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=_user("Hi"))
    finally:
        server.stop()
