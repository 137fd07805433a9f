"""POST /v1/responses through the official `openai` client (the default model, an in-process
server): text and message-list input with instructions, the same tokens as chat completions,
the streamed event sequence, function tools with their results fed back, text.format
json_schema, max_output_tokens (incomplete), previous_response_id and store, errors by name."""

from __future__ import annotations

import json

import live_server
import openai
import pytest

from kvflow import EngineArgs

pytestmark = pytest.mark.slow
MODEL = "smol"
ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def client():
    args = EngineArgs(max_model_len=1024, kv_cache_memory_gb=0.1, disable_log_stats=True, enable_prefix_caching=False)
    with live_server.served_engine(args, MODEL) as (server, _):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_text_input_gives_chats_tokens(client):
    resp = client.responses.create(model=MODEL, input=ASK, max_output_tokens=16, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=16,
                                          temperature=0)
    assert resp.status in ("completed", "incomplete") and resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens


def test_instructions_and_message_items(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    resp = client.responses.create(model=MODEL, input=items, instructions="Answer in one word.", max_output_tokens=8,
                                   temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": ASK}])
    assert resp.output_text == chat.choices[0].message.content and resp.instructions == "Answer in one word."


def test_the_stream_is_the_apis_event_sequence(client):
    whole = client.responses.create(model=MODEL, input=ASK, max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model=MODEL, input=ASK, max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    _final_items_are_the_streamed_ones(events)


def _final_items_are_the_streamed_ones(events) -> None:
    """The last event's output holds the items the stream closed: the same ids, the same content."""
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done and [item.model_dump() for item in events[-1].response.output] == [item.model_dump() for item in done]


def test_a_named_function_call_and_its_result_fed_back(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                    max_output_tokens=40)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER],
                                     temperature=0, max_output_tokens=16)
    assert second.output_text and second.usage.input_tokens > first.usage.input_tokens
    # The same conversation sent whole, without the store, is the same request.
    whole = client.responses.create(model=MODEL, temperature=0, max_output_tokens=16, tools=[WEATHER], store=False,
                                    input=[{"role": "user", "content": "What is the weather in Paris?"},
                                           {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                            "arguments": call.arguments}, result])
    assert whole.output_text == second.output_text
    streamed = list(client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                            tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                            max_output_tokens=40, stream=True))
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments
    _final_items_are_the_streamed_ones(streamed)


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    resp = client.responses.create(model=MODEL, input=ASK, max_output_tokens=30, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert set(json.loads(resp.output_text)) == {"city"}


def test_max_output_tokens_makes_it_incomplete(client):
    resp = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3


def test_previous_response_ids_that_are_not_kept_are_a_404_that_says_why(client):
    unstored = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, store=False)
    for previous in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError, match="not a stored response"):
            client.responses.create(model=MODEL, input="and?", previous_response_id=previous, max_output_tokens=2)


@pytest.mark.parametrize("kwargs, says", [
    ({"input": [{"type": "reasoning", "summary": []}]}, "items of type 'reasoning' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]}, "'input_file'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, "Files API"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "must be a data: URL"),
    ({"input": ASK, "tools": [{"type": "web_search"}]}, "tools of type 'web_search'"),
    ({"input": ASK, "tool_choice": {"type": "function", "name": "fly"}, "tools": [WEATHER]}, "fly"),
])
def test_what_it_cannot_do_is_a_400_by_name(client, kwargs, says):
    with pytest.raises(openai.BadRequestError, match=says):
        client.responses.create(model=MODEL, max_output_tokens=2, **kwargs)
