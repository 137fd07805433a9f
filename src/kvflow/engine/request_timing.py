"""Per-request latencies (TTFT, inter-token gaps, end-to-end), read where outputs are made.

The engine thread sees every RequestOutput the moment `step()` returns it, while the request's
`metrics` still describe that step; later steps overwrite them. So timings are taken there, not
by the consumer that reads the output some time later.

With speculative decoding one step can bring several tokens: the gap since the previous step is
shared evenly among them, so every token after a completion's first still counts one gap and the
gaps still add up to the time it took. (Outputs are counted as deltas, which is what the server
asks for.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.engine.outputs import RequestOutput


@dataclass(frozen=True)
class FinishedRequest:
    """What metrics learn about one request that ran to its end (aborted ones are not counted)."""

    request_id: str
    time_to_first_token: float
    e2e_latency: float
    inter_token_latencies: tuple[float, ...]  # one per token after each completion's first


@dataclass
class RequestTiming:
    request_id: str
    time_to_first_token: float | None = None
    _last_token_time: dict[int, float] = field(default_factory=dict)  # completion index → time
    _gaps: list[float] = field(default_factory=list)
    _aborted: bool = False

    def observe(self, outputs: list[RequestOutput]) -> FinishedRequest | None:
        """Record one step's outputs of this request (n > 1: one per completion that moved);
        returns the summary when they are its last."""
        for out in outputs:
            self._observe_one(out)
        last = outputs[-1]
        if not last.finished or self._aborted or self.time_to_first_token is None or last.metrics is None:
            return None
        end = last.metrics.finished_time or last.metrics.last_token_time
        return FinishedRequest(self.request_id, self.time_to_first_token, end - last.metrics.arrival_time,
                               tuple(self._gaps))

    def _observe_one(self, out: RequestOutput) -> None:
        metrics = out.metrics
        if metrics is None:
            return
        if self.time_to_first_token is None and metrics.first_token_time is not None:
            self.time_to_first_token = metrics.first_token_time - metrics.arrival_time
        for completion in out.outputs:
            if completion.finish_reason == "abort":
                self._aborted = True
            elif completion.token_ids and metrics.last_token_time is not None:
                self._record_tokens(completion.index, metrics.last_token_time, len(completion.token_ids))

    def _record_tokens(self, index: int, when: float, count: int) -> None:
        previous = self._last_token_time.get(index)
        if previous is None:  # the completion's first token opens no gap
            self._gaps.extend([0.0] * (count - 1))
        else:
            self._gaps.extend([(when - previous) / count] * count)
        self._last_token_time[index] = when
