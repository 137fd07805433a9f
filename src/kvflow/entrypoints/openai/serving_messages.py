"""POST /v1/messages: Anthropic's Messages API over the chat machinery, for Claude-style clients
and agents (the official `anthropic` client, with `base_url` set to this server).

A request becomes a chat request (`system` → a system message; text, `tool_use` and
`tool_result` content blocks → chat text, tool calls and tool messages; `tools`' `input_schema` →
function parameters; `tool_choice` auto / any / tool / none → auto / required / named / none;
`stop_sequences` → stop) and runs as chat completions do. Its output becomes content blocks (text,
and a `tool_use` per call with its parsed `input`), `stop_reason` (end_turn, max_tokens,
stop_sequence, tool_use) and usage. Streamed, it is the API's events: message_start, per block
content_block_start / _delta (text_delta, input_json_delta) / _stop, message_delta (the stop
reason and output tokens), message_stop. Errors come in the API's own shape (`anthropic_error`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import Field, ValidationError
from starlette.responses import Response

from kvflow.entrypoints.openai.errors import APIError, from_exception, from_validation
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIBody
from kvflow.entrypoints.openai.responses import ToolCall
from kvflow.entrypoints.openai.serving import EventStreamResponse, finish_reason
from kvflow.entrypoints.openai.serving_chat import ChatServing

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class MessagesRequest(OpenAIBody):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    metadata: dict | None = None


class MessagesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, req: MessagesRequest) -> dict | EventStreamResponse:
        chat_req = _chat_request(req)
        lora_request = self.chat.check_model(chat_req.model)
        params = self.chat.sampling_params(chat_req, chat_req.max_new_tokens, None)
        prompt = await self.chat.render_prompt(chat_req)
        message_id = f"msg_{uuid.uuid4().hex}"
        [stream] = await self.chat.start(message_id, [self.chat.with_images(chat_req, prompt)], params, lora_request,
                                         chat_req.cache_salt)
        head = {"id": message_id, "type": "message", "role": "assistant", "model": req.model or self.chat.model_name}
        if req.stream:
            return EventStreamResponse(_anthropic_errors(self._events(head, chat_req, stream)), on_close=stream.close)
        choice, content, calls = await self.chat.collect_whole(chat_req, stream)
        blocks = ([{"type": "text", "text": content}] if content or not calls else []) + [_tool_use(c) for c in calls]
        stop_reason, stop_sequence = _stop(choice.finish_reason, choice.stop_reason, bool(calls))
        return {**head, "content": blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": choice.prompt_tokens, "output_tokens": len(choice.token_ids)}}

    async def _events(self, head: dict, chat_req: ChatCompletionRequest, stream) -> AsyncIterator[str]:
        output = self.chat.choice_output(chat_req)
        blocks = _Blocks()
        prompt_tokens = generated = 0
        reason = stop_string = None
        started = False
        async for out in stream:
            prompt_tokens = len(out.prompt_token_ids)
            if not started:
                started = True
                yield _event("message_start", message={**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                                       "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}})
            for delta in out.outputs:
                generated += len(delta.token_ids)
                reason = finish_reason(delta)
                stop_string = delta.stop_reason if reason else None
                content, calls = output.feed(delta.text, final=reason is not None)
                for event in blocks.text(content) + blocks.calls(calls):
                    yield event
        for event in blocks.close():
            yield event
        stop_reason, stop_sequence = _stop(reason, stop_string, blocks.num_calls > 0)
        yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     usage={"output_tokens": generated})
        yield _event("message_stop")


class _Blocks:
    """Content blocks opened and closed as text and tool calls stream in."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text", or the call index of an open tool_use block
        self.num_calls = 0

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = []
        if self.open != "text":
            events += self.close()
            self.index, self.open = self.index + 1, "text"
            events.append(_event("content_block_start", index=self.index, content_block={"type": "text", "text": ""}))
        return events + [_event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": text})]

    def calls(self, deltas) -> list[str]:
        events = []
        for delta in deltas:
            if self.open != ("call", delta.index):
                events += self.close()
                self.index, self.open = self.index + 1, ("call", delta.index)
                self.num_calls += 1
                block = {"type": "tool_use", "id": delta.id, "name": delta.function.name, "input": {}}
                events.append(_event("content_block_start", index=self.index, content_block=block))
            if delta.function.arguments:
                events.append(_event("content_block_delta", index=self.index,
                                     delta={"type": "input_json_delta", "partial_json": delta.function.arguments}))
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


async def _anthropic_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A failure once the stream has started is an `error` event in the API's shape; no [DONE]."""
    try:
        async with aclosing(events):  # closing us closes it (and the request) at once
            async for event in events:
                yield event
    except Exception as e:
        error = from_exception(e)
        yield _event("error", error={"type": _ERROR_TYPES.get(error.status, "api_error"), "message": error.message})


def anthropic_error(response: Response) -> Response:
    """An error answer rewritten in the Messages API's shape (the others pass as they are)."""
    if response.status_code < 400 or response.media_type != "application/json":
        return response
    try:
        message = json.loads(response.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(response.status_code, "api_error"), "message": message}}
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return Response(json.dumps(body), status_code=response.status_code, media_type="application/json", headers=headers)


def _stop(finish: str | None, stop_string, calls: bool) -> tuple[str, str | None]:
    if finish == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(stop_string, str):
        return "stop_sequence", stop_string
    return "end_turn", None


def _tool_use(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:  # cut by max_tokens: stop_reason says so
        arguments = {}
    return {"type": "tool_use", "id": call.id, "name": call.function.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def _chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    messages = [] if req.system is None else [{"role": "system", "content": _plain_text(req.system, "system")}]
    for index, message in enumerate(req.messages):
        messages += _chat_messages(message, index)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                            "stop": req.stop_sequences or None}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                           "parameters": t.get("input_schema")}} for t in req.tools]
    choice = req.tool_choice or {}
    kind = choice.get("type")
    if kind in ("auto", "any", "none"):
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    elif kind == "tool":
        body["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif kind is not None:
        raise APIError(400, f"tool_choice.type must be auto, any, tool or none; got {kind!r}", param="tool_choice")
    if choice.get("disable_parallel_tool_use"):
        body["parallel_tool_calls"] = False
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise from_validation(e) from None


def _chat_messages(message: dict, index: int) -> list[dict]:
    """One Messages-API message as chat messages: a user's tool results become tool messages (in
    order, before its text), an assistant's tool_use blocks its tool calls."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise APIError(400, f"messages[{index}].role must be user or assistant; got {role!r}", param=f"messages[{index}]")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"messages[{index}].content must be a string or a list of blocks", param=f"messages[{index}]")
    parts, calls, results = [], [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image" and role == "user":
            parts.append(_image_part(block.get("source"), f"messages[{index}].content"))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _plain_text(block.get("content", ""), f"messages[{index}].content")})
        else:
            raise APIError(400, f"messages[{index}].content: {role} blocks of type {kind!r} are not supported by this "
                                "server (text, tool_use from the assistant, image and tool_result from the user)",
                           param=f"messages[{index}].content")
    text = "".join(p["text"] for p in parts if p["type"] == "text")
    if role == "assistant":
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]
    if any(p["type"] == "image_url" for p in parts):  # the parts in order: the template places each image
        return results + [{"role": "user", "content": parts}]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def _image_part(source: Any, where: str) -> dict:
    """An image block's source as a chat image_url part: base64 data becomes a data: URL; a url
    source stays a URL, which the chat request's check refuses (the server fetches nothing)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return {"type": "image_url", "image_url": {"url": f"data:{source.get('media_type', '')};base64,{source.get('data', '')}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise APIError(400, f"{where}: an image block's source must be {{'type': 'base64', 'media_type': ..., 'data': ...}} "
                        f"or {{'type': 'url', 'url': ...}}; got type {kind!r}", param=where)


def _plain_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(b.get("text", "") for b in content)
    raise APIError(400, f"{where}: only text is supported here (a string or text blocks)", param=where)
