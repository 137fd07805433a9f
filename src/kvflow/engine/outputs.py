"""What callers get back, shaped like vLLM's so code written for it reads the same."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per position: token id → Logprob (the chosen token plus the top-N alternatives).
PositionLogprobDict = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobDict] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # Why a completion ended with finish_reason "error": its output could not go on as asked (its
    # structured-output constraint had no valid continuation, or the grammar library gave up).
    # The text so far is kept, but it does not satisfy the request.
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # KV moved between this engine and another (disaggregated prefill/decode): saved by a
    # prefill engine, loaded by a decode engine
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobDict | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
