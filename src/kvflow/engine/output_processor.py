"""Turns sampled tokens into RequestOutputs: text deltas, stop strings, logprobs, timings.

One `RequestState` per engine request. A request with n > 1 runs as n child requests that share
one `ParentRequest`, which assembles their completions into a single RequestOutput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvflow.core.request import Request, RequestStatus
from kvflow.core.runner_output import ModelRunnerOutput, PositionLogprobs
from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.engine.outputs import CompletionOutput, Logprob, PositionLogprobDict, RequestMetrics, RequestOutput
from kvflow.model.tokenizer import Tokenizer
from kvflow.sampling_params import RequestOutputKind


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    children: list[RequestState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobDict | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


@dataclass
class RequestState:
    request: Request
    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobDict] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why it ended with finish_reason "error"
    sent_text: int = 0  # for DELTA outputs: what the caller already has
    sent_tokens: int = 0

    @property
    def kind(self) -> RequestOutputKind:
        return self.request.sampling_params.output_kind


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: Request, parent: ParentRequest, index: int) -> None:
        params = request.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, params) if self.tokenizer else None
        state = RequestState(request, parent, index, detok)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None] * len(request.prompt_token_ids)
        parent.children.append(state)
        self.states[request.request_id] = state

    def record_kv_transfers(self, runner_out: ModelRunnerOutput) -> None:
        for request_id, transfer in runner_out.kv_transfer.items():
            state = self.states.get(request_id)
            if state is not None:
                state.parent.metrics.kv_transfer_bytes += transfer.bytes
                state.parent.metrics.kv_transfer_seconds += transfer.seconds

    def process(self, produced: list[tuple[Request, int]],
                runner_out: ModelRunnerOutput) -> tuple[list[RequestOutput], list[str]]:
        """`produced`: each request that got tokens this step, with how many (several with
        speculative decoding). Returns the outputs to hand out and the ids of requests a stop
        string just ended (the scheduler must finish those)."""
        now = time.monotonic()
        self._record_prompt_logprobs(runner_out)
        stopped, touched = [], []
        for request, num_new in produced:
            state = self.states[request.request_id]
            state.parent.metrics.first_token_time = state.parent.metrics.first_token_time or now
            state.parent.metrics.last_token_time = now
            logprobs = runner_out.logprobs.get(request.request_id)
            new_tokens = request.output_token_ids[-num_new:]
            for i, token in enumerate(new_tokens):
                # One token at a time, as without speculation: a stop string ends the output at
                # the token that completed it, and the tokens after it are dropped.
                last = i == num_new - 1
                if self._append_token(state, request, token, None if logprobs is None else logprobs[i], last):
                    stopped.append(request.request_id)
                    break
            touched.append(state)
        return self._outputs(touched, now), stopped

    def finish_aborted(self, request_ids: list[str]) -> list[RequestOutput]:
        touched = []
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is not None and state.finish_reason is None:
                state.finish_reason = RequestStatus.FINISHED_ABORTED.finish_reason
                touched.append(state)
        return self._outputs(touched, time.monotonic())

    def finish_failed(self, errors: dict[str, str]) -> list[RequestOutput]:
        """End these requests with finish_reason "error" and why (request id → message): their
        output could not go on as asked. The text produced so far is released whole."""
        touched = []
        for request_id, message in errors.items():
            state = self.states.get(request_id)
            if state is not None and state.finish_reason is None:
                state.finish_reason, state.error = RequestStatus.FINISHED_ERROR.finish_reason, message
                if state.detokenizer is not None:
                    state.detokenizer.append([], final=True)
                touched.append(state)
        return self._outputs(touched, time.monotonic())

    def _append_token(self, state: RequestState, request: Request, token: int, lp: PositionLogprobs | None,
                      last: bool) -> bool:
        """`last`: the step's last token for this request, the one a finish applies to."""
        state.token_ids.append(token)
        if lp is not None:
            state.logprobs.append(self._logprob_dict(lp))
            state.cumulative_logprob += lp.logprobs[0]
        finish = request.status.finish_reason if last else None
        stop_string = None
        if state.detokenizer is not None:
            stop_string = state.detokenizer.append([token], final=finish is not None)
        if stop_string is not None:
            state.finish_reason, state.stop_reason = "stop", stop_string
            return True
        if finish is not None:
            state.finish_reason, state.stop_reason = finish, request.stop_reason
            if state.detokenizer is not None:
                state.detokenizer.append([], final=True)
        return False

    def _record_prompt_logprobs(self, runner_out: ModelRunnerOutput) -> None:
        for request_id, (first_pos, entries) in runner_out.prompt_logprobs.items():
            parent = self.states[request_id].parent
            # Positions are absolute, so a chunk recomputed after preemption overwrites itself.
            for offset, lp in enumerate(entries):
                parent.prompt_logprobs[first_pos + offset] = self._logprob_dict(lp)

    def _logprob_dict(self, lp: PositionLogprobs) -> PositionLogprobDict:
        decode = (lambda i: self.tokenizer.decode([i])) if self.tokenizer else (lambda i: None)
        top = zip(lp.token_ids[1:], lp.logprobs[1:])
        out = {tid: Logprob(value, rank, decode(tid)) for rank, (tid, value) in enumerate(top, 1)}
        out[lp.token_ids[0]] = Logprob(lp.logprobs[0], lp.rank, decode(lp.token_ids[0]))
        return out

    # -- assembling RequestOutputs ---------------------------------------------------------
    def _outputs(self, touched: list[RequestState], now: float) -> list[RequestOutput]:
        outputs, done_parents = [], set()
        for state in touched:
            parent = state.parent
            if state.finish_reason is not None:
                self.states.pop(state.request.request_id, None)
            if parent.finished:
                parent.metrics.finished_time = parent.metrics.finished_time or now
            if state.kind is RequestOutputKind.FINAL_ONLY:
                if parent.finished and parent.request_id not in done_parents:
                    done_parents.add(parent.request_id)
                    outputs.append(self._request_output(parent, parent.children))
            else:
                outputs.append(self._request_output(parent, [state]))
        return outputs

    def _request_output(self, parent: ParentRequest, states: list[RequestState]) -> RequestOutput:
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=[self._completion(s) for s in states],
            finished=parent.finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.children[0].request.num_cached_tokens,
        )

    def _completion(self, state: RequestState) -> CompletionOutput:
        full = state.detokenizer.text if state.detokenizer else ""
        end = len(full)
        if state.finish_reason is None and state.request.sampling_params.stop:
            # Hold back what could still become the start of a stop string.
            end = max(0, end - state.request.sampling_params.max_stop_len + 1)
        delta = state.kind is RequestOutputKind.DELTA
        text = full[state.sent_text:end] if delta else full[:end]  # one slice: no per-token copy of it all
        token_ids, logprobs = state.token_ids, state.logprobs
        if delta:
            token_ids = token_ids[state.sent_tokens:]
            logprobs = None if logprobs is None else logprobs[state.sent_tokens:]
            state.sent_text += len(text)
            state.sent_tokens += len(token_ids)
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=None if logprobs is None else list(logprobs),
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            error=state.error,
        )
