"""Iteration-level scheduling without phases.

Every request catches its `num_computed_tokens` up to `num_tokens`. Each step spends one token
budget: running requests first (decodes, then unfinished prompt chunks), then waiting requests in
arrival order, their prompts cut to what the budget leaves (chunked prefill). When the pool runs
out of blocks the newest running request is preempted: its blocks are freed and it is recomputed
later from its prompt and the tokens it already produced, so its output does not change.
"""

from __future__ import annotations

from collections import deque

from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request, RequestStatus
from kvflow.core.sched_output import ScheduledChunk, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions_total = 0

    # -- admission -------------------------------------------------------------------------
    def admission_error(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of this size can never run, or None if it can."""
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens >= self.max_model_len or total > self.max_model_len:
            return (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens "
                    f"exceeds max_model_len ({self.max_model_len})")
        # The last sampled token is never written to the cache.
        blocks = self.kv_cache.blocks_needed(total - 1)
        if blocks > self.kv_cache.num_blocks:
            return (f"request needs {blocks} KV blocks ({total} tokens) but the whole cache has "
                    f"{self.kv_cache.num_blocks}; raise kv_cache_memory_gb or lower max_tokens")
        return None

    def add_request(self, request: Request) -> None:
        error = self.admission_error(request.num_prompt_tokens, request.max_tokens)
        if error:
            raise ValueError(error)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        budget = self.config.max_num_batched_tokens
        # Decodes (one uncomputed token) before unfinished prompts; stable, so FCFS within each.
        for request in sorted(self.running, key=lambda r: r.num_uncomputed_tokens > 1):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_uncomputed_tokens, budget)
            num_preempted = len(out.preempted_request_ids)
            reserved = self._reserve_or_preempt(request, num_new, out)
            if len(out.preempted_request_ids) > num_preempted:
                # A victim may have been scheduled earlier in this loop: take its chunk back.
                gone = set(out.preempted_request_ids)
                out.chunks = [c for c in out.chunks if c.request_id not in gone]
                budget = self.config.max_num_batched_tokens - out.num_batched_tokens
            if reserved:
                out.chunks.append(self._chunk(request, num_new))
                budget -= num_new
        if not out.preempted_request_ids:  # the pool is tight: admit nobody new this step
            budget = self._admit_waiting(budget, out)
        return out

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_uncomputed_tokens, budget)
            if not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return budget

    def _reserve_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for `request`, preempting the newest running requests as needed.
        False if `request` itself had to be preempted."""
        while not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:start + num_new],
            start_pos=start,
            block_ids=self.kv_cache.block_ids(request.request_id),
            sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
        )

    # -- after the model ran ---------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that hit a stop.
        Returns the requests that produced a token this step."""
        produced = []
        for chunk in out.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += chunk.num_tokens
            if not chunk.sample:
                continue
            request.append_output_token(sampled[chunk.request_id])
            produced.append(request)
            status = request.check_stop(self.max_model_len)
            if status is not None:
                self._finish(request, status)
        return produced

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache.free(request.request_id)
        del self.requests[request.request_id]
        self._finished_since_last_step.add(request.request_id)
