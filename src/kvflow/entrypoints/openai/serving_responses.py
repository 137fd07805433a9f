"""POST /v1/responses: OpenAI's Responses API over the chat machinery.

A request becomes a chat request (input items → messages, `instructions` → a system message,
flat function tools → chat tools, `text.format` → response_format, `max_output_tokens` →
max_tokens) and is checked, rendered and run exactly as chat completions are; its output becomes
output items: a `message` with `output_text`, and a `function_call` per tool call (the calls a
client answers with `function_call_output` items in its next request). Streamed, it is the API's
event sequence: response.created, response.in_progress, per item output_item.added, the text's
(or the arguments') deltas and done events, output_item.done, then response.completed (or
response.incomplete when max_output_tokens cut it).

`store` (the default) keeps a response's conversation, for `previous_response_id`, in this
process's memory only: the newest `MAX_STORED` responses, each for `STORE_TTL_S` seconds; a
restart forgets them all. `store: false` keeps nothing. n is 1: the API has no n.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from kvflow.entrypoints.openai.errors import APIError, from_validation
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIBody
from kvflow.entrypoints.openai.responses import ToolCall
from kvflow.entrypoints.openai.serving import EventStreamResponse, finish_reason
from kvflow.entrypoints.openai.serving_chat import ChatServing

MAX_STORED = 1024  # responses kept for previous_response_id
STORE_TTL_S = 3600.0


class ResponsesRequest(OpenAIBody):
    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    seed: int | None = None  # kvflow's extra, as on chat
    ignore_eos: bool = False  # vLLM's extra, as on chat: generate max_output_tokens (benchmarks)

    @model_validator(mode="after")
    def _supported(self):
        if self.background:
            raise ValueError("background responses are not supported by this server")
        return self


class ResponseStore:
    """Conversations of stored responses: id → (when, messages including the response's own)."""

    def __init__(self, max_entries: int = MAX_STORED, ttl_s: float = STORE_TTL_S) -> None:
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._entries: OrderedDict[str, tuple[float, list[dict]]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict]) -> None:
        self._entries[response_id] = (time.monotonic(), messages)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> list[dict]:
        entry = self._entries.get(response_id)
        if entry is None or time.monotonic() - entry[0] > self.ttl_s:
            self._entries.pop(response_id, None)
            raise APIError(404, f"previous_response_id {response_id[:100]!r} is not a stored response (this server "
                                f"keeps the newest {self.max_entries} responses with store true for "
                                f"{self.ttl_s / 60:g} minutes, in memory)", param="previous_response_id",
                           code="previous_response_not_found")
        return entry[1]


class ResponsesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat
        self.store = ResponseStore()

    async def create(self, req: ResponsesRequest) -> dict | EventStreamResponse:
        history = self.store.get(req.previous_response_id) if req.previous_response_id else []
        messages = history + _messages(req.input)
        chat_req = _chat_request(req, messages)
        lora_request = self.chat.check_model(chat_req.model)
        params = self.chat.sampling_params(chat_req, chat_req.max_new_tokens, None)
        prompt = await self.chat.render_prompt(chat_req)
        response_id = f"resp_{uuid.uuid4().hex}"
        [stream] = await self.chat.start(response_id, [self.chat.with_images(chat_req, prompt)], params, lora_request,
                                         chat_req.cache_salt)
        state = _Response(response_id, req, chat_req, self.chat.model_name)
        if req.stream:
            return self.chat.event_stream(self._events(state, stream, messages), [stream])
        choice, content, calls = await self.chat.collect_whole(chat_req, stream)
        state.finish(_output_items(content, calls), choice.finish_reason, choice.prompt_tokens, len(choice.token_ids))
        self._keep(req, state, messages)
        return state.body()

    async def _events(self, state: _Response, stream, messages: list[dict]) -> AsyncIterator[str]:
        events = _EventWriter(state)
        yield events.send("response.created", response=state.body())
        yield events.send("response.in_progress", response=state.body())
        output = self.chat.choice_output(state.chat_req)
        prompt_tokens = generated = 0
        reason = None
        async for out in stream:
            prompt_tokens = len(out.prompt_token_ids)
            for delta in out.outputs:
                generated += len(delta.token_ids)
                reason = finish_reason(delta)
                content, calls = output.feed(delta.text, final=reason is not None)
                for event in events.content(content) + events.calls(calls):
                    yield event
        for event in events.close_all():
            yield event
        # The items as they were streamed (their ids, their text), not made anew.
        state.finish(events.done_items() or _output_items("", []), reason, prompt_tokens, generated)
        self._keep(state.req, state, messages)
        yield events.send("response.incomplete" if state.status == "incomplete" else "response.completed",
                          response=state.body())

    def _keep(self, req: ResponsesRequest, state: _Response, messages: list[dict]) -> None:
        if req.store:
            self.store.put(state.id, messages + state.as_messages())


class _Response:
    """One response's fields, as the API returns it whole and in its events."""

    def __init__(self, response_id: str, req: ResponsesRequest, chat_req: ChatCompletionRequest, model_name: str) -> None:
        self.id, self.req, self.chat_req = response_id, req, chat_req
        self.model = req.model or model_name
        self.created_at = int(time.time())
        self.status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
        self.output: list[dict] = []
        self.usage: dict | None = None
        self.incomplete_details: dict | None = None

    def finish(self, output: list[dict], reason: str | None, prompt_tokens: int, generated: int) -> None:
        self.output = output
        self.status = "incomplete" if reason == "length" else "completed"
        self.incomplete_details = {"reason": "max_output_tokens"} if reason == "length" else None
        self.usage = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt_tokens + generated}

    def as_messages(self) -> list[dict]:
        """This response's output as chat messages (what a stored conversation continues from)."""
        text = "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]

    def body(self) -> dict:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "model": self.model, "output": self.output, "usage": self.usage, "error": None,
            "incomplete_details": self.incomplete_details, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False, "text": req.text or {"format": {"type": "text"}},
            "previous_response_id": req.previous_response_id, "store": req.store, "metadata": req.metadata or {},
        }


class _EventWriter:
    """The stream's events in order, numbered; the output items opened and closed as text and
    tool calls arrive."""

    def __init__(self, state: _Response) -> None:
        self.state = state
        self.sequence = 0
        self._text = ""  # the open message item's
        self._message: dict | None = None  # the open message item
        self._calls: dict[int, dict] = {}  # call index → its item (open until the end)
        self._done: list[tuple[int, dict]] = []  # (output index, the item as its output_item.done sent it)
        self._items = 0

    def send(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"

    def content(self, text: str) -> list[str]:
        if not text:
            return []
        events = []
        if self._message is None:
            self._message = {**_message_item(f"msg_{uuid.uuid4().hex}", ""), "status": "in_progress",
                             "output_index": self._next_index()}
            events += [self.send("response.output_item.added", output_index=self._message["output_index"],
                                 item=_public(self._message, content=[])),
                       self.send("response.content_part.added", item_id=self._message["id"],
                                 output_index=self._message["output_index"], content_index=0, part=_text_part(""))]
        self._text += text
        return events + [self.send("response.output_text.delta", item_id=self._message["id"],
                                   output_index=self._message["output_index"], content_index=0, delta=text)]

    def calls(self, deltas) -> list[str]:
        events = []
        for delta in deltas:
            item = self._calls.get(delta.index)
            if item is None:
                events += self._close_message()
                item = {**_call_item(f"fc_{uuid.uuid4().hex}", delta.id, delta.function.name or "", ""),
                        "status": "in_progress", "output_index": self._next_index()}
                self._calls[delta.index] = item
                events.append(self.send("response.output_item.added", output_index=item["output_index"],
                                        item=_public(item)))
            piece = delta.function.arguments or ""
            if piece:
                item["arguments"] += piece
                events.append(self.send("response.function_call_arguments.delta", item_id=item["id"],
                                        output_index=item["output_index"], delta=piece))
        return events

    def close_all(self) -> list[str]:
        events = self._close_message()
        for item in self._calls.values():
            item["status"] = "completed"
            events += [self.send("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=item["output_index"], arguments=item["arguments"]),
                       self._item_done(item["output_index"], _public(item))]
        self._calls.clear()
        return events

    def done_items(self) -> list[dict]:
        """Every item closed so far, in output order."""
        return [item for _, item in sorted(self._done, key=lambda done: done[0])]

    def _item_done(self, index: int, item: dict) -> str:
        self._done.append((index, item))
        return self.send("response.output_item.done", output_index=index, item=item)

    def _close_message(self) -> list[str]:
        item = self._message
        if item is None:
            return []
        text, self._message, self._text = self._text, None, ""
        index = item["output_index"]
        return [self.send("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=text),
                self.send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=_text_part(text)),
                self._item_done(index, _public(item, status="completed", content=[_text_part(text)]))]

    def _next_index(self) -> int:
        self._items += 1
        return self._items - 1


def _public(item: dict, **changes: Any) -> dict:
    return {k: v for k, v in {**item, **changes}.items() if k != "output_index"}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _output_items(text: str, calls: list[ToolCall]) -> list[dict]:
    """A whole response's items: its message (also when it is empty and there is no call), then its calls."""
    return ([_message_item(f"msg_{uuid.uuid4().hex}", text)] if text or not calls else []) + [
        _call_item(f"fc_{uuid.uuid4().hex}", c.id, c.function.name, c.function.arguments) for c in calls]


def _message_item(item_id: str, text: str) -> dict:
    return {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [_text_part(text)]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}


def _messages(items: str | list[dict]) -> list[dict]:
    """Input items as chat messages: messages (their text parts), a model's function calls (one
    assistant message for consecutive ones), and the caller's function_call_output results."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), index)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        else:
            raise APIError(400, f"input[{index}]: items of type {kind!r} are not supported by this server "
                                "(message, function_call, function_call_output)", param=f"input[{index}]")
    return messages


def _content(content: Any, index: int) -> Any:
    """A message's content: a string, or its parts as chat parts (input_text / output_text as text,
    input_image as image_url, whose data: URL the chat request's own check reads)."""
    if not isinstance(content, list):
        return content
    return [_chat_part(part, f"input[{index}].content") for part in content]


def _chat_part(part: Any, where: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        if not isinstance(part.get("image_url"), str):
            raise APIError(400, f"{where}: an input_image needs image_url, a data: URL (images by file_id need the "
                                "Files API, which this server does not have)", param=where)
        detail = {"detail": part["detail"]} if part.get("detail") is not None else {}
        return {"type": "image_url", "image_url": {"url": part["image_url"], **detail}}
    raise APIError(400, f"{where}: parts of type {kind!r} are not supported by this server "
                        "(input_text, output_text, input_image)", param=where)


def _chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat request this response runs as; its checks (tools, tool_choice, the format's
    schema, sampling ranges) answer for it, their field names the chat ones."""
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    body: dict[str, Any] = {"model": req.model, "messages": messages, "temperature": req.temperature,
                            "top_p": req.top_p, "max_tokens": req.max_output_tokens, "seed": req.seed,
                            "parallel_tool_calls": req.parallel_tool_calls, "ignore_eos": req.ignore_eos}
    if req.tools:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = ({"type": "function", "function": {"name": req.tool_choice.get("name")}}
                               if isinstance(req.tool_choice, dict) else req.tool_choice)
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    elif isinstance(fmt, dict) and fmt.get("type") != "text":
        body["response_format"] = fmt
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise from_validation(e) from None


def _chat_tool(tool: dict, index: int) -> dict:
    if tool.get("type") != "function":
        raise APIError(400, f"tools[{index}]: tools of type {tool.get('type')!r} are not supported by this server "
                            "(function)", param=f"tools[{index}]")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}
