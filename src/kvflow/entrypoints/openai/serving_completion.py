"""POST /v1/completions: one engine request per prompt, n completions each.

Choice `index` runs over prompts then completions (prompt i, completion j → i * n + j), as
OpenAI numbers them. `echo` puts the prompt in front of the text, and with `logprobs` the prompt
tokens' logprobs in front of the completion's (the first prompt token has none).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from kvflow.engine.async_llm import RequestStream
from kvflow.engine.outputs import CompletionOutput, PositionLogprobDict, RequestOutput
from kvflow.entrypoints.openai.errors import bad_request
from kvflow.entrypoints.openai.protocol import CompletionRequest
from kvflow.entrypoints.openai.responses import Completion, CompletionChoice, CompletionLogprobs, Usage
from kvflow.entrypoints.openai.serving import (
    MIN_LOGPROB,
    Choice,
    EventStreamResponse,
    Serving,
    close_all,
    finish_reason,
    merge,
    sse,
)


@dataclass
class _Cursor:
    """Where a streamed choice stands: whether its echo went out, and its text offset so far."""

    echoed: bool = False
    offset: int = 0


class CompletionServing(Serving):
    async def create(self, req: CompletionRequest) -> Completion | EventStreamResponse:
        lora_request = self.check_model(req.model)
        prompts = req.prompts()
        self.check_fan_out(len(prompts), req.n)
        asked = [n for n in (req.logprobs if req.echo else None, req.prompt_logprobs) if n is not None]
        prompt_logprobs = max(asked) if asked else None
        params = self.sampling_params(req, req.max_new_tokens, req.logprobs, prompt_logprobs)
        prompts = await self._tokenized(prompts)
        self.check_logprobs([len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p) for p in prompts], params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        beam = self.beam_search_params(req, params)
        streams = await self.start(request_id, prompts, params, lora_request, req.cache_salt, beam)
        if req.stream:
            return self.event_stream(self._events(request_id, req, streams), streams)
        try:
            return await self._collect(request_id, req, streams)
        finally:
            close_all(streams)

    async def _tokenized(self, prompts: list[str | list[int]]) -> list[dict | list[int]]:
        """Text prompts tokenized on the worker pool; the engine gets ids (and the text, for echo)."""
        result = []
        for index, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                result.append(prompt)
                continue
            try:
                result.append({"prompt": prompt, "prompt_token_ids": await self.tokenizer.encode(prompt)})
            except ValueError as e:
                raise bad_request(ValueError((f"prompt {index}: " if len(prompts) > 1 else "") + str(e))) from None
        return result

    async def _collect(self, request_id: str, req: CompletionRequest, streams: list[RequestStream]) -> Completion:
        choices = [Choice() for _ in range(len(streams) * req.n)]
        firsts: dict[int, RequestOutput] = {}
        async with aclosing(merge(streams)) as outputs:
            async for prompt_index, out in outputs:
                firsts.setdefault(prompt_index, out)
                for delta in out.outputs:
                    choices[prompt_index * req.n + delta.index].add(delta)
        result = []
        for index, choice in enumerate(choices):
            cursor = _Cursor()
            text, ids, positions = ("", [], []) if req.scores_only else (choice.text, choice.token_ids, choice.logprobs)
            text, logprobs = self._piece(firsts[index // req.n], text, ids, positions, req, cursor)
            result.append(CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=choice.finish_reason,
                                           prompt_logprobs=self.prompt_logprobs(firsts[index // req.n],
                                                                                req.prompt_logprobs)))
        prompt_tokens = sum(len(out.prompt_token_ids) for out in firsts.values())
        generated = 0 if req.scores_only else sum(len(c.token_ids) for c in choices)
        return Completion(id=request_id, model=req.model or self.model_name, choices=result,
                          usage=Usage.of(prompt_tokens, generated))

    async def _events(self, request_id: str, req: CompletionRequest, streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        cursors = [_Cursor() for _ in range(len(streams) * req.n)]
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        async with aclosing(merge(streams)) as outputs:
            async for prompt_index, out in outputs:
                prompt_tokens[prompt_index] = len(out.prompt_token_ids)
                completion_tokens += 0 if req.scores_only else sum(len(delta.token_ids) for delta in out.outputs)
                choices = [c for delta in out.outputs if (c := self._delta(out, delta, prompt_index, req, cursors))]
                if choices:
                    usage = Usage.of(sum(prompt_tokens.values()), completion_tokens) if req.continuous_usage else None
                    yield sse(Completion(id=request_id, created=created, model=req.model or self.model_name,
                                         choices=choices, usage=usage))
        if req.include_usage:
            usage = Usage.of(sum(prompt_tokens.values()), completion_tokens)
            yield sse(Completion(id=request_id, created=created, model=req.model or self.model_name, choices=[],
                                 usage=usage))

    def _delta(self, out: RequestOutput, delta: CompletionOutput, prompt_index: int, req: CompletionRequest,
               cursors: list[_Cursor]) -> CompletionChoice | None:
        """One streamed choice, or None when the step added nothing to send (text held back)."""
        index, reason = prompt_index * req.n + delta.index, finish_reason(delta)
        echo_due = req.echo and not cursors[index].echoed
        text, ids, positions = ("", [], []) if req.scores_only else (delta.text, delta.token_ids, delta.logprobs or [])
        if not (text or reason or echo_due or (req.logprobs is not None and ids)):
            return None
        text, logprobs = self._piece(out, text, ids, positions, req, cursors[index])
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason)

    def _piece(self, out: RequestOutput, text: str, token_ids: list[int], positions: list[PositionLogprobDict],
               req: CompletionRequest, cursor: _Cursor) -> tuple[str, CompletionLogprobs | None]:
        """The text (and logprobs) of one choice from `cursor` on, the echoed prompt first."""
        echo = req.echo and not cursor.echoed
        cursor.echoed = True
        prefix = self._prompt_text(out) if echo else ""
        if req.logprobs is None:
            return prefix + text, None
        logprobs = CompletionLogprobs()
        if echo:
            prompt_positions = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            self._append(logprobs, out.prompt_token_ids, prompt_positions, req.logprobs, cursor)
        self._append(logprobs, token_ids, positions, req.logprobs, cursor)
        return prefix + text, logprobs

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tokenizer = self.async_llm.tokenizer
        return tokenizer.decode(out.prompt_token_ids) if tokenizer else ""

    def _append(self, logprobs: CompletionLogprobs, token_ids: list[int], positions: list[PositionLogprobDict | None],
                top_n: int, cursor: _Cursor) -> None:
        for token_id, position in zip(token_ids, positions):
            entry = position.get(token_id) if position else None
            text = entry.decoded_token if entry and entry.decoded_token is not None else self.token_text(token_id)
            logprobs.tokens.append(text)
            logprobs.token_logprobs.append(None if entry is None else max(entry.logprob, MIN_LOGPROB))
            logprobs.top_logprobs.append(None if position is None else {
                (lp.decoded_token if lp.decoded_token is not None else self.token_text(t)): max(lp.logprob, MIN_LOGPROB)
                for t, lp in position.items() if t == token_id or (lp.rank is not None and lp.rank <= top_n)})
            logprobs.text_offset.append(cursor.offset)
            cursor.offset += len(text)
