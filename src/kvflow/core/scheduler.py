"""Iteration-level scheduling without phases.

Every request catches its `num_computed_tokens` up to `num_tokens`. Each step spends one token
budget: running requests first (decodes, then unfinished prompt chunks), then waiting requests in
order, their prompts cut to what the budget leaves (chunked prefill) and started from their
longest cached prefix. When the pool runs out of blocks the last request in order is preempted:
its blocks are freed (cached ones stay findable) and it is recomputed later from its prompt and
the tokens it already produced, so its output does not change.

Order is one key for both policies: arrival for "fcfs"; (priority, arrival) for "priority",
where a waiting request may also preempt running requests that come after it. With
preemption_mode="swap" a preempted request's KV is copied to host blocks instead of being
recomputed, when the host pool has room.

With LoRA, the requests running at once use at most `max_loras` distinct adapters (the device
slots): a waiting request whose adapter would be one too many waits, and later ones may pass it.

Speculative decoding enters as proposals: a decode verifies the tokens proposed for it after the
previous step, in the same chunk, when the budget and the pool allow (it never preempts for them).
After the step the rejected ones are rolled back out of `num_computed_tokens` before any block is
hashed, so only accepted tokens ever reach the prefix cache; the accepted tokens are appended one
by one, each checked for a stop. A sliding-window group needs no margin for that rollback: it
gives blocks back only below the window of `num_computed_tokens` as it stood when the step was
scheduled, and a rollback never goes below that (the chunk's own tokens stay computed).

A step's requests are in flight from `schedule()` until its batch lands (`update_from_output`,
or `batch_landed` for a batch that failed). With pipeline parallel several batches are in flight
at once: a request in flight is neither scheduled again (its next tokens are not known yet) nor
preempted, and one that ends meanwhile (an abort) keeps its blocks until its batch lands, since
later pipeline stages may still write its KV. A synchronous engine lands each batch before the next schedule, so nothing
there ever sees a request in flight.

A request with a KV budget (`core/kv_eviction.py`) computes no chunk across an eviction point,
and is preempted by recompute (its evictions happen again at the same points).

A connector whose loads run beside the steps (`kv_connector.loads_async`: KV offloading) parks a
request whose tokens it loads in WAITING_FOR_REMOTE_KVS, its blocks allocated: it is neither
waiting nor running, takes a sequence slot, and may be preempted (its load cancelled) like a
running request. Other requests keep stepping. When the worker reports its blocks landed
(`loads_landed`) it runs from there; when the load fails (`recompute_failed_loads`) its blocks go
back and it waits again, to compute its prompt.
"""

from __future__ import annotations

import itertools
from collections.abc import Set

from kvflow.config import SchedulerConfig
from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.kv_connector import KVConnectorScheduler
from kvflow.core.kv_eviction import KVEviction
from kvflow.core.request import Request, RequestStatus
from kvflow.core.sched_output import ScheduledChunk, SchedulerOutput
from kvflow.core.waiting_queue import WaitingQueue
from kvflow.spec_decode.policy import SpeculationPolicy


class SchedulerStallError(RuntimeError):
    """Waiting requests that cannot start although nothing runs: no step will ever change that,
    so they are reported (and ended) instead of being retried forever."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"requests {request_ids} can never be scheduled with this KV pool")
        self.request_ids = request_ids


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                 host_pool: BlockPool | None = None, max_loras: int | None = None,
                 speculation: SpeculationPolicy | None = None, kv_connector: KVConnectorScheduler | None = None,
                 pool_size_setting: str = "kv_cache_memory_gb") -> None:
        """`pool_size_setting`: the engine argument that sized the KV pool, for the advice of a
        request too big for it."""
        self.config = config
        self.pool_size_setting = pool_size_setting
        self.max_loras = max_loras  # None: no LoRA
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.host_pool = host_pool  # swap space, in blocks
        self.speculation = speculation
        self.kv_connector = kv_connector  # KV loaded from / saved for other engines
        self._host_blocks_read = []  # swapped in this step: reusable once the step's copies are done
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(self._order)
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self.in_flight: set[str] = set()  # requests in a batch that has not landed
        self._free_when_landed: dict[str, Request] = {}  # ended while in flight: their blocks wait
        # WAITING_FOR_REMOTE_KVS: request id → (its status before, tokens computed once its load lands)
        self._loading: dict[str, tuple[RequestStatus, int]] = {}
        self._arrivals = itertools.count()
        self.num_preemptions_total = 0

    def _order(self, request: Request) -> tuple[int, int]:
        return (request.priority if self.config.policy == "priority" else 0, request.arrival_seq)

    # -- admission -------------------------------------------------------------------------
    def admission_error(self, num_prompt_tokens: int, max_tokens: int, eviction: KVEviction | None = None) -> str | None:
        """Why a request of this size can never run, or None if it can."""
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens >= self.max_model_len or total > self.max_model_len:
            return (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens "
                    f"exceeds max_model_len ({self.max_model_len})")
        if eviction is not None:
            blocks = self.kv_cache.max_blocks_held_within(total - 1, eviction)
            if blocks > self.kv_cache.num_blocks:
                return (f"kv_budget_tokens ({eviction.budget_tokens}) needs {blocks} KV blocks but the whole cache "
                        f"has {self.kv_cache.num_blocks}; lower kv_budget_tokens or raise {self.pool_size_setting}")
            return None
        # The last sampled token is never written to the cache; a sliding-window group holds
        # only the blocks of its window (and of the chunk being computed).
        if self._max_chunk(total) == 0:
            blocks = self.kv_cache.max_blocks_held(total - 1, 1)
            return (f"request needs {blocks} KV blocks ({total} tokens) but the whole cache has "
                    f"{self.kv_cache.num_blocks}; raise {self.pool_size_setting} or lower max_tokens")
        return None

    def _max_chunk(self, total_tokens: int) -> int:
        return self.kv_cache.max_chunk(total_tokens - 1, self.config.max_num_batched_tokens)

    def add_request(self, request: Request) -> None:
        error = self.admission_error(request.num_prompt_tokens, request.max_tokens, request.eviction)
        if error:
            raise ValueError(error)
        # On a sliding-window model a chunk's blocks must fit beside the window's: a request whose
        # whole context exceeds the pool still runs, in chunks that fit. With a KV budget, chunks
        # end at eviction points (_chunk_limit).
        if request.eviction is None:
            request.max_chunk_tokens = self._max_chunk(request.num_prompt_tokens + request.max_tokens)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.arrival_seq = next(self._arrivals)
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        self.waiting.push(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting to start, and waiting for their KV to load."""
        return len(self.waiting) + len(self._loading)

    # -- one step --------------------------------------------------------------------------
    def schedule(self, held: Set[str] = frozenset()) -> SchedulerOutput:
        """`held`: requests that may not sample this step (what they sample with is not ready:
        a grammar's masks); they may still compute prompt chunks that sample nothing."""
        out = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        # Decodes (one uncomputed token) before unfinished prompts; stable, so in order within each.
        for request in sorted(self.running, key=lambda r: r.num_uncomputed_tokens > 1):
            budget = self._budget_left(out)
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING or request.request_id in self.in_flight:
                continue  # preempted earlier in this loop, or its last batch has not landed
            num_new = min(request.num_uncomputed_tokens, budget, self._chunk_limit(request))
            if request.request_id in held and num_new == request.num_uncomputed_tokens:
                num_new -= 1  # up to the token that would sample
                if num_new == 0:
                    continue
            drafts = self._proposals_to_verify(request, num_new, budget)
            if self._reserve_or_preempt(request, num_new, out):
                out.add(self._chunk(request, num_new, drafts))
        if not out.preempted_request_ids or self.config.policy == "priority":
            self._admit_waiting(out, held)
        if self.waiting and not self.running and not self._loading and not out.preempted_request_ids and not held:
            self._finished_since_last_step |= out.finished_request_ids  # still owed to the worker
            raise SchedulerStallError([self.waiting.peek().request_id])
        if self._host_blocks_read:
            self.host_pool.release(self._host_blocks_read)
            self._host_blocks_read = []
        out.block_copies = self.kv_cache.take_block_copies()
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out.chunks, self.requests)
        self.in_flight.update(c.request_id for c in out.chunks)
        return out

    def give_back(self, out: SchedulerOutput) -> None:
        """A batch the engine does not run (nothing in it, batches in flight): the requests it
        reports finished go with the next."""
        self._finished_since_last_step |= out.finished_request_ids
        self.in_flight.difference_update(c.request_id for c in out.chunks)

    def batch_landed(self, out: SchedulerOutput) -> None:
        """`out`'s batch came back (or failed): its requests may be scheduled again, and those that
        ended meanwhile give their blocks back."""
        for chunk in out.chunks:
            self.in_flight.discard(chunk.request_id)
            ended = self._free_when_landed.pop(chunk.request_id, None)
            if ended is not None:
                self.kv_cache.free(ended)

    @staticmethod
    def _chunk_limit(request: Request) -> int:
        """The longest chunk the request may compute next: what fits the pool, and never past an
        eviction point."""
        if request.eviction is not None:
            return request.eviction.chunk_limit(request.num_computed_tokens)
        return request.max_chunk_tokens

    def _budget_left(self, out: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - out.num_batched_tokens

    def _admit_waiting(self, out: SchedulerOutput, held: Set[str]) -> None:
        # Requests whose prefix another request is computing, whose adapter has no slot, or that
        # may not sample yet (a resumed request's first chunk may be its last).
        held_back = []
        adapters = {r.lora_int_id for r in self._holding_slots()} - {0}
        while (self.waiting and self._budget_left(out) > 0
               and len(self.running) + len(self._loading) < self.config.max_num_seqs):
            request = self.waiting.pop()
            if request.request_id in held or (
                    request.lora_int_id and request.lora_int_id not in adapters and len(adapters) >= (self.max_loras or 0)):
                held_back.append(request)
                continue
            starts = self._start_points(request)
            if self._reuses_cache(request) and self.kv_cache.prefix_in_flight(request, starts[0][1]):
                held_back.append(request)
                continue
            allocated = self._allocate_first_chunk(request, starts, out)
            if allocated is None:
                self._enqueue(request)
                break
            if allocated[2]:
                self._start_running(request, *allocated, out)
            else:  # its external tokens load beside the steps; no chunk until they land
                self._park_for_load(request, allocated[0], allocated[1])
            adapters |= {request.lora_int_id} - {0}
        for request in held_back:
            self._enqueue(request)

    def _holding_slots(self) -> list[Request]:
        """Requests holding a sequence slot and blocks: running, and waiting for their KV to load."""
        return [*self.running, *(self.requests[request_id] for request_id in self._loading)]

    def _start_points(self, request: Request) -> list[tuple[tuple[list[int], ...], int]]:
        """Where a waiting request may resume: (cached blocks to reuse, tokens they cover), best
        first. A whole-prompt hit needs a spare block for its copy; whole blocks alone need none."""
        if request.status is RequestStatus.SWAPPED:
            return [((), request.num_computed_tokens)]
        if not self._reuses_cache(request):
            return [((), 0)]
        best = self.kv_cache.find_cached_prefix(request)
        whole = best[1] == request.num_tokens - 1  # a whole-prompt hit may end inside a cached block
        fallback = self.kv_cache.find_cached_prefix(request, whole_blocks_only=True) if whole else best
        # Offered whenever its blocks differ, even covering as many tokens: a whole-prompt hit
        # that ends where a block starts needs a spare block for its copy, the fallback does not.
        return [best] if fallback[0] == best[0] else [best, fallback]

    @staticmethod
    def _reuses_cache(request: Request) -> bool:
        """A swapped request brings its own KV; one that still owes prompt logprobs must compute
        every prompt position (its blocks are still cached for others); one with a KV budget
        computes its own (past the first eviction point its KV is not the full context's)."""
        owes_prompt_logprobs = request.sampling_params.prompt_logprobs is not None and request.status is RequestStatus.WAITING
        return request.status is not RequestStatus.SWAPPED and not owes_prompt_logprobs and request.uses_prefix_cache

    def _start_running(self, request: Request, start: int, num_external: int, num_new: int,
                       out: SchedulerOutput) -> None:
        """`start` tokens are in the local cache, the next `num_external` are loaded by the connector."""
        if request.status is RequestStatus.SWAPPED:
            self._swap_in(request, out)
        elif self._reuses_cache(request):
            self.kv_cache.record_lookup(request.num_tokens, start)
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = start + num_external
        request.num_computed_tokens = start + num_external
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        # The allocated count, not the budget left now: preempting victims for the allocation may
        # have returned their tokens to the budget, but no blocks were taken for those.
        out.add(self._chunk(request, num_new))

    def _allocate_first_chunk(self, request: Request, starts: list[tuple[tuple[list[int], ...], int]],
                              out: SchedulerOutput) -> tuple[int, int, int] | None:
        """(tokens cached locally, tokens the connector loads, first chunk's length) from the
        first start point whose blocks fit; None if none does. A chunk of 0: the connector loads
        beside the steps, and the blocks are the loaded tokens' alone."""
        for blocks, n in starts:
            external = 0
            if self.kv_connector is not None and self._reuses_cache(request):
                external = self.kv_connector.get_num_matched_tokens(request, n)
            compute = not (external and self.kv_connector.loads_async)
            num_new = self._allocate_for_waiting(request, n, blocks, out, external, compute)
            if num_new is not None:
                if external:
                    self.kv_connector.update_state_after_alloc(request, self.kv_cache.block_ids(request.request_id)[0],
                                                               n, external)
                return n, external, num_new
        return None

    def _allocate_for_waiting(self, request: Request, num_cached: int, cached: tuple[list[int], ...],
                              out: SchedulerOutput, num_external: int = 0, compute: bool = True) -> int | None:
        """Blocks for the external tokens and (with `compute`) the first chunk; returns the chunk's
        length (None: no room). Under the priority policy a waiting request may preempt running
        ones behind it."""
        # Loaded tokens spend no budget, but their blocks are allocated with the chunk's.
        num_new = min(request.num_tokens - num_cached - num_external, self._budget_left(out),
                      self._chunk_limit(request)) if compute else 0
        while not self.kv_cache.allocate_slots(request, num_cached, num_external + num_new, cached):
            victim = self._victim()
            if self.config.policy != "priority" or victim is None or self._order(victim) < self._order(request):
                return None
            self._preempt(victim, out)
        return num_new

    def _reserve_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for `request`, preempting the last running requests in order as needed.
        False if `request` itself had to be preempted."""
        while not self.kv_cache.allocate_slots(request, request.num_computed_tokens, num_new):
            victim = self._victim()
            if victim is None:  # every other running request is in flight: this one waits
                return False
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _victim(self) -> Request | None:
        """The last request in order holding blocks that is not in flight (it may be preempted):
        running, or waiting for its KV to load."""
        return max((r for r in self._holding_slots() if r.request_id not in self.in_flight), key=self._order,
                   default=None)

    def _proposals_to_verify(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The proposals a decode verifies this step: what the budget, max_tokens (k proposals
        yield up to k + 1 tokens) and free blocks allow, all or none; never a preemption."""
        if not request.spec_token_ids or num_new != request.num_uncomputed_tokens:
            return []
        room = min(budget, self._chunk_limit(request)) - num_new
        drafts = request.spec_token_ids[:min(room, request.num_tokens_allowed - 1)]
        if drafts and self.kv_cache.allocate_slots(request, request.num_computed_tokens, num_new + len(drafts)):
            return drafts
        return []

    def _lookahead(self, request: Request, num_scheduled: int) -> int:
        """Tokens to propose after this step's sampling. A proposer that writes KV gets its slots
        now, if the pool has them; otherwise the request does not speculate next step."""
        if self.speculation is None:
            return 0
        # At least one token is appended this step and proposals must leave room for one more.
        k = min(self.speculation.num_lookahead_tokens(request.request_id, len(self.running)),
                request.num_tokens_allowed - 2)
        if k <= 0:
            return 0
        if self.speculation.reserves_kv_slots and not self.kv_cache.allocate_slots(
                request, request.num_computed_tokens, num_scheduled + k):
            return 0
        return k

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        if request.request_id in self._loading:
            self._preempt_load(request, out)
            return
        self.running.remove(request)
        request.spec_token_ids = []
        if self.config.preemption_mode == "swap" and request.eviction is None and self._swap_out(request, out):
            request.status = RequestStatus.SWAPPED
        else:
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = request.num_evicted_tokens = 0
        self.kv_cache.free(request)
        self.num_preemptions_total += 1
        out.preempted_request_ids.append(request.request_id)
        out.drop(request.request_id)  # it may have been scheduled earlier in this step
        self._enqueue(request)

    def _park_for_load(self, request: Request, num_cached: int, num_external: int) -> None:
        """Blocks are allocated for its cached and external tokens, the connector told which to
        load into: it waits for the load."""
        self._loading[request.request_id] = (request.status, num_cached + num_external)
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS

    def loads_landed(self, request_ids: Set[str]) -> None:
        """The worker copied these requests' loaded KV into their blocks: they run from there
        (the loaded blocks findable in the prefix cache at once, counted as prefix-cache hits)."""
        for request_id in request_ids:
            if request_id not in self._loading:  # ended or preempted since (the worker dropped it)
                continue
            request = self.requests[request_id]
            status, computed = self._loading.pop(request_id)
            self.kv_connector.loads_landed([request_id])
            self.kv_cache.record_lookup(request.num_tokens, computed)
            if status is RequestStatus.WAITING:
                request.num_cached_tokens = computed
            request.num_computed_tokens = computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.kv_cache.cache_computed_blocks(request)

    def _drop_load(self, request: Request) -> None:
        """Out of WAITING_FOR_REMOTE_KVS, its blocks freed (fresh, never findable), back to what
        it was before; the caller says what the connector does and where the request goes."""
        request.status, _ = self._loading.pop(request.request_id)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0

    def _preempt_load(self, request: Request, out: SchedulerOutput) -> None:
        self._drop_load(request)
        self.kv_connector.cancel_load(request)
        self.num_preemptions_total += 1
        out.preempted_request_ids.append(request.request_id)
        self._enqueue(request)

    def _swap_out(self, request: Request, out: SchedulerOutput) -> bool:
        """Copy the blocks holding the request's computed tokens to host memory, if there is room."""
        blocks = self.kv_cache.resumable_blocks(request)
        if self.host_pool is None or len(blocks) > self.host_pool.num_free_blocks:
            return False
        request.host_blocks = self.host_pool.allocate(len(blocks))
        out.swap_out.extend(zip(blocks, request.host_blocks))
        return True

    def _swap_in(self, request: Request, out: SchedulerOutput) -> None:
        device = self.kv_cache.resumable_blocks(request)
        out.swap_in.extend(zip(device, request.host_blocks))
        self._host_blocks_read.extend(request.host_blocks)
        request.host_blocks = []

    def _chunk(self, request: Request, num_new: int, drafts: list[int] = ()) -> ScheduledChunk:
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens
        lookahead = self._lookahead(request, num_new + len(drafts)) if sample else 0
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=[*request.all_token_ids[start:start + num_new], *drafts],
            start_pos=start,
            block_ids=self.kv_cache.block_ids(request.request_id),
            sample=sample,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
            lora_request=request.lora_request,
            num_spec_tokens=len(drafts),
            num_lookahead_tokens=lookahead,
            num_evicted_tokens=request.num_evicted_tokens,
            images=request.images,
        )

    # -- after the model ran ---------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           draft_token_ids: dict[str, list[int]] | None = None) -> list[tuple[Request, int]]:
        """Advance computed tokens (less the rejected proposals), append the sampled tokens up to
        the first that stops the request, finish it if one did, and keep the new proposals.
        Returns each request that produced tokens this step with how many it kept."""
        self.batch_landed(out)
        produced = []
        for chunk in out.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if not chunk.sample:
                request.num_computed_tokens += chunk.num_tokens
                self.kv_cache.cache_computed_blocks(request)
                continue
            tokens = sampled[chunk.request_id]
            num_accepted = len(tokens) - 1  # proposals kept; the last token is the target's own
            request.num_computed_tokens += chunk.num_tokens - (chunk.num_spec_tokens - num_accepted)
            self.kv_cache.cache_computed_blocks(request)  # before any output: the prompt's tail block too
            if chunk.num_spec_tokens and self.speculation is not None:
                self.speculation.observe(request.request_id, chunk.num_spec_tokens, num_accepted)
            status, kept = request.append_output_tokens(tokens, self.max_model_len)
            if num_accepted:  # blocks the accepted proposals completed
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                self.kv_cache.cache_computed_blocks(request)
            produced.append((request, kept))
            if status is not None:
                self._finish(request, status)
            else:
                request.spec_token_ids = (draft_token_ids or {}).get(request.request_id, [])
        return produced

    def recompute_failed_loads(self, out: SchedulerOutput, request_ids: set[str]) -> None:
        """The worker could not load these requests' KV from the connector's store (a block was
        evicted after the lookup, or the store went away): the step ran them on wrong KV, so none
        of it counts. Their blocks (fresh, never made findable) go back, and they wait again, to
        compute their prompts here: the connector loads nothing more for them."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request_id in self._loading:
                self._drop_load(request)
                self.kv_connector.request_load_failed(request)
                self._enqueue(request)
                continue
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            self.running.remove(request)
            self.kv_cache.free(request)
            self.kv_connector.request_load_failed(request)
            request.num_computed_tokens = request.num_cached_tokens = request.num_evicted_tokens = 0
            request.status = RequestStatus.WAITING
            out.drop(request_id)
            self._enqueue(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.request_id in self._loading:
            self._drop_load(request)  # the connector cancels its load (request_finished)
        else:
            self.waiting.remove(request)
        request.status = status
        request.spec_token_ids = []
        if self.speculation is not None:
            self.speculation.forget(request.request_id)
        if request.request_id in self.in_flight:
            self._free_when_landed[request.request_id] = request
        else:
            self.kv_cache.free(request)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request)
        if request.host_blocks:
            self.host_pool.release(request.host_blocks)
            request.host_blocks = []
        del self.requests[request.request_id]
        self._finished_since_last_step.add(request.request_id)
