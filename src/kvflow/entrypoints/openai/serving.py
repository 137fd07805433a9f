"""What chat and completions serving share: the model check, SamplingParams from a request,
starting one engine request per prompt, merging their output streams, and SSE framing.

Every output is a DELTA, streamed or not: the non-streaming path sums the deltas itself, and the
engine thread sees every token of every request, which is where the latency metrics come from.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvflow.engine.async_llm import AsyncLLM, RequestStream
from kvflow.engine.beam_search import AsyncBeamSearch, BeamSearchParams
from kvflow.engine.llm_engine import PromptType
from kvflow.engine.outputs import CompletionOutput, PositionLogprobDict, RequestOutput
from kvflow.entrypoints.openai.errors import APIError, bad_request, from_exception
from kvflow.entrypoints.openai.limits import ServerLimits
from kvflow.entrypoints.openai.protocol import SamplingFields
from kvflow.entrypoints.openai.responses import PromptLogprob, PromptLogprobs
from kvflow.entrypoints.openai.serving_models import ServingModels
from kvflow.entrypoints.openai.tokenization import PromptTokenizer
from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import RequestOutputKind, SamplingParams

SSE_DONE = "data: [DONE]\n\n"
_PLAIN = SamplingParams()
_NOT_WITH_BEAM_SEARCH = ("top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                         "stop", "stop_token_ids", "min_tokens", "logprobs", "prompt_logprobs", "logit_bias",
                         "structured_outputs", "include_stop_str_in_output")
MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clients expect a number


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


@dataclass
class Choice:
    """One completion summed from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobDict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    prompt_tokens: int = 0

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason = finish_reason(delta) or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.finish_reason else self.stop_reason


def finish_reason(delta: CompletionOutput) -> str | None:
    """The reason a completion ended, as a client may be told it; every choice's finish reason is
    read here. A completion the engine ended with an error (finish_reason "error": its
    structured-output constraint had no valid continuation, or the grammar library gave up) is
    no answer at all: the whole request fails with a 400 (a stream: an error event after what was
    already sent, then [DONE]), never a "stop" over text that does not satisfy the request."""
    if delta.finish_reason == "error":
        reason = delta.error or "its output constraint failed"
        raise APIError(400, f"the output could not be completed as the request constrains it: {reason}",
                       code="structured_output_failed")
    return delta.finish_reason


class Serving:
    def __init__(self, async_llm: AsyncLLM, models: ServingModels, limits: ServerLimits, tokenizer: PromptTokenizer) -> None:
        self.async_llm = async_llm
        self.models = models
        self.model_name = models.base_name
        self.limits = limits
        self.tokenizer = tokenizer

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter the request's `model` names (None: the base model); 404 if none is served."""
        return self.models.resolve(model)

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if len(req.stop or ()) > self.limits.max_stop_sequences:
            raise APIError(400, f"at most {self.limits.max_stop_sequences} stop sequences (--max-stop-sequences); "
                                f"got {len(req.stop)}", param="stop")
        try:
            return SamplingParams(
                n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, temperature=req.temperature,
                top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty, seed=req.seed,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, output_kind=RequestOutputKind.DELTA,
                structured_outputs=req.structured_outputs_params(), logit_bias=req.token_logit_bias(),
                kv_eviction_policy=req.kv_eviction_policy, kv_budget_tokens=req.kv_budget_tokens,
            )
        except ValueError as e:
            raise bad_request(e) from None

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        """Refuse, before any work, a request that would start too many completions."""
        limits = self.limits
        if num_prompts > limits.max_prompts_per_request:
            raise APIError(400, f"at most {limits.max_prompts_per_request} prompts per request "
                                f"(--max-prompts-per-request); got {num_prompts}", param="prompt")
        if num_prompts * n > limits.max_seqs_per_request:
            raise APIError(400, f"prompts x n = {num_prompts} x {n} = {num_prompts * n} completions is more than "
                                f"{limits.max_seqs_per_request} per request (--max-seqs-per-request)", param="n")

    def check_logprobs(self, prompt_lens: list[int], params: SamplingParams) -> None:
        """Refuse up front a request whose logprobs alone would take too much memory: each
        completion's tokens x (top + 1), and each prompt's tokens x (top + 1) when echoed."""
        entries = 0
        for prompt_len in prompt_lens:
            if params.logprobs is not None:
                max_new = params.max_tokens or max(1, self.async_llm.max_model_len - prompt_len)
                entries += params.n * max_new * (params.logprobs + 1)
            if params.prompt_logprobs is not None:
                entries += prompt_len * (params.prompt_logprobs + 1)
        if entries > self.limits.max_logprob_entries:
            raise APIError(400, f"this request would produce {entries} logprobs (tokens x alternatives), more than "
                                f"{self.limits.max_logprob_entries} (--max-logprob-entries); lower n, max_tokens "
                                "or the number of logprobs", param="logprobs")

    def beam_search_params(self, req: SamplingFields, params: SamplingParams) -> BeamSearchParams | None:
        """vLLM's `use_beam_search`: the n best beams rather than n samples (None: not asked).
        What beam search cannot honour is refused by name: it samples nothing and stops only at
        an end-of-sequence token or the length limit."""
        if not req.use_beam_search:
            if req.length_penalty != 1.0:
                raise APIError(400, "`length_penalty` ranks beams: it applies only with use_beam_search",
                               param="length_penalty")
            return None
        asked = [name for name in _NOT_WITH_BEAM_SEARCH if getattr(params, name) != getattr(_PLAIN, name)]
        if "temperature" in req.model_fields_set and req.temperature > 0:
            asked.insert(0, "temperature")
        if asked:
            raise APIError(400, f"`{asked[0]}` does not apply to beam search (use_beam_search ranks beams by the "
                                "model's log-probabilities and stops only at end of sequence or max_tokens)",
                           param=asked[0])
        return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens or self.async_llm.max_model_len,
                                ignore_eos=params.ignore_eos, length_penalty=req.length_penalty)

    async def start(self, request_id: str, prompts: list[PromptType], params: SamplingParams,
                    lora_request: LoRARequest | None = None, cache_salt: str | None = None,
                    beam: BeamSearchParams | None = None) -> list[RequestStream]:
        """One engine request per prompt, all or none: the first refusal closes the others, and so
        does a client that leaves (cancellation) while they are being queued. `cache_salt`: the
        prompts share cached KV blocks only with requests of the same salt. With `beam`, each
        prompt's stream is a beam search whose first step has run (`BeamSearchStream`)."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        kwargs = dict(cache_salt=cache_salt, lora_request=lora_request)
        adds = [asyncio.ensure_future(self.async_llm.add_request(i, p, params, **kwargs) if beam is None
                                      else BeamSearchStream.start(self.async_llm, i, p, beam, **kwargs))
                for i, p in zip(ids, prompts)]
        try:
            results = await asyncio.gather(*adds, return_exceptions=True)
        except asyncio.CancelledError:  # the adds are cancelled too; close what they already got
            close_all([a.result() for a in adds if a.done() and not a.cancelled() and a.exception() is None])
            raise
        streams = [r for r in results if not isinstance(r, BaseException)]
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if not failed:
            return streams
        close_all(streams)
        index, error = failed[0]
        if isinstance(error, ValueError):
            prefix = f"prompt {index}: " if len(prompts) > 1 else ""
            raise bad_request(ValueError(prefix + str(error))) from None
        raise error

    def prompt_logprobs(self, out: RequestOutput, asked: int | None) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs` of a prompt: at each position its token and the top `asked`."""
        if asked is None or out.prompt_logprobs is None:
            return None
        return [None if position is None else {
            str(t): PromptLogprob(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank,
                                  decoded_token=lp.decoded_token if lp.decoded_token is not None else self.token_text(t))
            for t, lp in position.items() if t == token or (lp.rank is not None and lp.rank <= asked)}
            for token, position in zip(out.prompt_token_ids, out.prompt_logprobs)]

    def token_text(self, token_id: int) -> str:
        tokenizer = self.async_llm.tokenizer
        return tokenizer.decode([token_id]) if tokenizer else f"token_id:{token_id}"

    def event_stream(self, events: AsyncIterator[str], streams: list[RequestStream]) -> EventStreamResponse:
        return EventStreamResponse(_with_errors(events), on_close=lambda: close_all(streams))


class BeamSearchStream:
    """A beam search read like a RequestStream: one finished output holding the n beams, best
    first. Its first step ran in `start`, so the engine's refusals came before any answer;
    closing it while a step runs (the reader's task cancelled) ends that step's requests."""

    def __init__(self, search: AsyncBeamSearch, prompt: PromptType) -> None:
        self.request_id = search.request_id
        self.search = search
        self.prompt_text = prompt.get("prompt") if isinstance(prompt, dict) else prompt if isinstance(prompt, str) else None
        self.finished = False

    @classmethod
    async def start(cls, client, request_id: str, prompt: PromptType, params: BeamSearchParams,
                    **request_kwargs) -> BeamSearchStream:
        search = AsyncBeamSearch(client, request_id, prompt, params, **request_kwargs)
        await search.first_step()
        return cls(search, prompt)

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        self.finished = True
        result = await self.search.finish()
        return result.as_request_output(self.request_id, self.prompt_text)

    def close(self) -> None:
        self.finished = True


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
            queue.put_nowait((index, None))
        except Exception as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def _with_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once a stream has started the status is sent: an error becomes an event carrying the
    OpenAI error object, followed by the usual end marker."""
    try:
        async with aclosing(events):  # closing us closes it, and the merge inside it, at once
            async for event in events:
                yield event
    except Exception as e:
        yield sse(from_exception(e).body())
    yield SSE_DONE


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose requests are closed (aborted if unfinished) however the response
    ends: finished, failed, or the client went away."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            self._on_close()
