"""POST /v1/chat/completions: messages (and tools) → chat template → one engine request with n
completions; each completion's text becomes content and tool calls (tool_parsers.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kvflow.engine.async_llm import AsyncLLM, RequestStream
from kvflow.engine.outputs import PositionLogprobDict
from kvflow.entrypoints.openai.errors import APIError, bad_request
from kvflow.entrypoints.openai.limits import ServerLimits
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest
from kvflow.entrypoints.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    Delta,
    DeltaToolCall,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from kvflow.entrypoints.openai.serving import MIN_LOGPROB, Choice, EventStreamResponse, Serving, finish_reason, sse
from kvflow.entrypoints.openai.tokenization import PromptTokenizer
from kvflow.entrypoints.openai.tool_parsers import TOOL_PARSERS, ChoiceOutput, NamedFunctionOutput, choice_output, whole_calls

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.serving_models import ServingModels


class ChatServing(Serving):
    def __init__(self, async_llm: AsyncLLM, models: ServingModels, limits: ServerLimits, tokenizer: PromptTokenizer,
                 tool_call_parser: str = "hermes") -> None:
        super().__init__(async_llm, models, limits, tokenizer)
        if tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}; got {tool_call_parser!r}")
        self.tool_call_parser = tool_call_parser  # how `tool_choice="auto"` finds calls in the text

    async def create(self, req: ChatCompletionRequest) -> ChatCompletion | EventStreamResponse:
        lora_request = self.check_model(req.model)
        self.check_fan_out(1, req.n)
        params = self.sampling_params(req, req.max_new_tokens, req.num_logprobs, req.prompt_logprobs)
        prompt = await self.render_prompt(req)
        self.check_logprobs([len(prompt)], params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        beam = self.beam_search_params(req, params)
        [stream] = await self.start(request_id, [self.with_images(req, prompt, beam)], params, lora_request,
                                    req.cache_salt, beam)
        if req.stream:
            return self.event_stream(self._events(request_id, req, stream), [stream])
        try:
            return await self._collect(request_id, req, stream)
        finally:
            stream.close()

    @staticmethod
    def with_images(req: ChatCompletionRequest, prompt: list[int], beam=None) -> list[int] | dict:
        """The engine's prompt: the rendered tokens, with the messages' images beside them (the
        template wrote one <image> per image; the engine expands each to its tiles' tokens)."""
        images = [image for message in req.messages for image in message.images()]
        if not images:
            return prompt
        if beam is not None:
            raise APIError(400, "use_beam_search does not take image parts yet", param="use_beam_search")
        return {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}

    async def render_prompt(self, req: ChatCompletionRequest) -> list[int]:
        try:
            return await self.tokenizer.render_conversation(req)
        except ValueError as e:  # no tokenizer or template, the template refused the conversation, too long
            raise bad_request(e) from None

    async def _collect(self, request_id: str, req: ChatCompletionRequest, stream: RequestStream) -> ChatCompletion:
        choices = [Choice() for _ in range(req.n)]
        prompt_tokens, first = 0, None
        async for out in stream:
            prompt_tokens, first = len(out.prompt_token_ids), first or out
            for delta in out.outputs:
                choices[delta.index].add(delta)
        return ChatCompletion(
            id=request_id, model=req.model or self.model_name,
            choices=[self._choice(i, c, req) for i, c in enumerate(choices)],
            usage=Usage.of(prompt_tokens, sum(len(c.token_ids) for c in choices)),
            prompt_logprobs=None if first is None else self.prompt_logprobs(first, req.prompt_logprobs),
        )

    def _choice(self, index: int, choice: Choice, req: ChatCompletionRequest) -> ChatChoice:
        output = self.choice_output(req)
        content, deltas = output.feed(choice.text, final=True)
        calls = whole_calls(deltas)
        message = AssistantMessage(content=content or (None if calls else ""), tool_calls=calls or None)
        return ChatChoice(index=index, message=message, finish_reason=_finish_reason(choice.finish_reason, output),
                          logprobs=self._logprobs(choice.token_ids, choice.logprobs, req))

    async def collect_whole(self, req: ChatCompletionRequest, stream: RequestStream) -> tuple[Choice, str, list[ToolCall]]:
        """A one-choice request run to its end (the stream closed however it ends): the choice (with
        its prompt's length), its content, and the tool calls read from it."""
        choice = Choice()
        try:
            async for out in stream:
                choice.prompt_tokens = len(out.prompt_token_ids)
                for delta in out.outputs:
                    choice.add(delta)  # a broken constraint fails the request here
        finally:
            stream.close()
        content, deltas = self.choice_output(req).feed(choice.text, final=True)
        return choice, content, whole_calls(deltas)

    def choice_output(self, req: ChatCompletionRequest) -> ChoiceOutput:
        return choice_output(req.tool_mode, self.tool_call_parser, req.forced_function)

    async def _events(self, request_id: str, req: ChatCompletionRequest, stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=req.model or self.model_name,
                                           choices=choices, usage=usage))

        for index in range(req.n):  # the role first, as OpenAI sends it
            yield chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])
        outputs = [self.choice_output(req) for _ in range(req.n)]
        prompt_tokens = completion_tokens = 0
        async for out in stream:
            prompt_tokens = len(out.prompt_token_ids)
            for delta in out.outputs:
                completion_tokens += len(delta.token_ids)
                output, reason = outputs[delta.index], finish_reason(delta)
                content, calls = output.feed(delta.text, final=reason is not None)
                if content or calls or reason or (req.logprobs and delta.token_ids):
                    yield chunk([ChatChunkChoice(
                        index=delta.index, delta=_delta(content, calls),
                        finish_reason=_finish_reason(reason, output),
                        logprobs=self._logprobs(delta.token_ids, delta.logprobs or [], req))],
                        Usage.of(prompt_tokens, completion_tokens) if req.continuous_usage else None)
        if req.include_usage:
            yield chunk([], Usage.of(prompt_tokens, completion_tokens))

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobDict],
                  req: ChatCompletionRequest) -> ChoiceLogprobs | None:
        if not req.logprobs:
            return None
        top_n = req.top_logprobs or 0
        content = []
        for token_id, position in zip(token_ids, positions):
            top = sorted((lp.rank, t) for t, lp in position.items() if lp.rank is not None and lp.rank <= top_n)
            content.append(TokenLogprob(
                **self._top(token_id, position), top_logprobs=[TopLogprob(**self._top(t, position)) for _, t in top]))
        return ChoiceLogprobs(content=content)

    def _top(self, token_id: int, position: PositionLogprobDict) -> dict:
        entry = position[token_id]
        text = entry.decoded_token if entry.decoded_token is not None else self.token_text(token_id)
        return {"token": text, "logprob": max(entry.logprob, MIN_LOGPROB), "bytes": list(text.encode("utf-8"))}


def _delta(content: str, calls: list[DeltaToolCall]) -> Delta:
    return Delta(content=content or (None if calls else ""), tool_calls=calls or None)


def _finish_reason(reason: str | None, output: ChoiceOutput) -> str | None:
    """OpenAI's reason for a completion that ended by calling tools; a call the request named
    (`tool_choice: {"type": "function", ...}`) is the answer asked for: "stop", as OpenAI and
    vLLM say."""
    named = isinstance(output, NamedFunctionOutput)
    return "tool_calls" if reason == "stop" and output.num_calls and not named else reason
