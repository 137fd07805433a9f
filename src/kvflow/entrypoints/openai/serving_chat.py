"""POST /v1/chat/completions: messages → chat template → one engine request with n completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from kvflow.engine.async_llm import RequestStream
from kvflow.engine.outputs import PositionLogprobDict
from kvflow.entrypoints.openai.errors import bad_request
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest
from kvflow.entrypoints.openai.responses import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChoiceLogprobs, Delta,
    TokenLogprob, TopLogprob, Usage,
)
from kvflow.entrypoints.openai.serving import MIN_LOGPROB, Choice, EventStreamResponse, Serving, sse


class ChatServing(Serving):
    async def create(self, req: ChatCompletionRequest) -> ChatCompletion | EventStreamResponse:
        self.check_model(req.model)
        self.check_fan_out(1, req.n)
        params = self.sampling_params(req, req.max_new_tokens, req.num_logprobs)
        prompt = await self._render(req)
        self.check_logprobs([len(prompt)], params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        [stream] = await self.start(request_id, [prompt], params)
        if req.stream:
            return self.event_stream(self._events(request_id, req, stream), [stream])
        try:
            return await self._collect(request_id, req, stream)
        finally:
            stream.close()

    async def _render(self, req: ChatCompletionRequest) -> list[int]:
        try:
            messages = [m.for_template() for m in req.messages]
            return await self.tokenizer.render_chat(messages, req.add_generation_prompt)
        except ValueError as e:  # no tokenizer or template, the template refused the conversation, too long
            raise bad_request(e) from None

    async def _collect(self, request_id: str, req: ChatCompletionRequest, stream: RequestStream) -> ChatCompletion:
        choices = [Choice() for _ in range(req.n)]
        prompt_tokens = 0
        async for out in stream:
            prompt_tokens = len(out.prompt_token_ids)
            for delta in out.outputs:
                choices[delta.index].add(delta)
        return ChatCompletion(
            id=request_id, model=self.model_name,
            choices=[ChatChoice(index=i, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                                logprobs=self._logprobs(c.token_ids, c.logprobs, req))
                     for i, c in enumerate(choices)],
            usage=Usage.of(prompt_tokens, sum(len(c.token_ids) for c in choices)),
        )

    async def _events(self, request_id: str, req: ChatCompletionRequest, stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices, usage=usage))

        for index in range(req.n):  # the role first, as OpenAI sends it
            yield chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])
        prompt_tokens = completion_tokens = 0
        async for out in stream:
            prompt_tokens = len(out.prompt_token_ids)
            for delta in out.outputs:
                completion_tokens += len(delta.token_ids)
                if delta.text or delta.finish_reason or (req.logprobs and delta.token_ids):
                    yield chunk([ChatChunkChoice(
                        index=delta.index, delta=Delta(content=delta.text), finish_reason=delta.finish_reason,
                        logprobs=self._logprobs(delta.token_ids, delta.logprobs or [], req))])
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
