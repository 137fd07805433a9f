"""What the live engine page (`GET /dashboard`) shows, taken from the engine without slowing it.

Watching must not slow a step, so the work is split three ways:
- Nobody watching: each engine iteration reads one flag (`SnapshotFeed.wanted`), and the engine's
  `step_log` is None, so a step records nothing.
- A viewer asks (`SnapshotFeed.ask`, any thread): it gets the latest published snapshot at once and,
  if that one is older than `MIN_INTERVAL_S`, raises the flag. Between steps, the engine thread
  copies what the page needs into an immutable `EngineSnapshot` (at most once a step, and only
  when asked since the last one) and publishes it by reference. However fast viewers poll, the
  engine and the server build and encode at most one snapshot per MIN_INTERVAL_S: faster polls
  get the same one (each poll costs the server its HTTP answer, as /health does). The copies are
  whole-list copies done in C (the pool's reference counts, the cached blocks, each request's
  block tables): no per-block Python on the engine thread.
- Everything per block (owners, sharing, states) is derived from the snapshot on the reader's
  thread (`derive_grid`), which never touches the scheduler's live structures.

While someone watches (and `LINGER_S` after the last look) the engine also keeps a `StepLog`: a
bounded deque of what each step spent its token budget on, for the page's bars.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from kvflow.core.kv_cache_manager import NULL_BLOCK
from kvflow.core.request import Request, RequestStatus
from kvflow.core.sched_output import SchedulerOutput
from kvflow.core.scheduler import Scheduler
from kvflow.engine.stats import EngineStats

if TYPE_CHECKING:
    from kvflow.lora.request import LoRARequest

STEP_RECORDS = 256  # steps the page's bars show
LINGER_S = 30.0  # steps are recorded this long after a viewer's last look (a paused page comes back)
MAX_QUEUED_SHOWN = 100  # not-running requests listed; the page gives the count of the rest
# The most often a snapshot is taken. Polled at 10 Hz, a snapshot a step (and its encoding) cost
# ~5% of W1's served throughput on a 2-core EPYC; at this interval, none measurable
# (docs/performance-journal.md, "The live page's cost").
MIN_INTERVAL_S = 0.25

# Block states, as the page colours them.
FREE, CACHED_FREE, HELD, SHARED = 0, 1, 2, 3


class SnapshotUnavailableError(RuntimeError):
    """This engine front has no single engine to show (data-parallel replicas)."""


class StepRecord(NamedTuple):
    """One step, made on the engine thread while someone watches: a plain tuple, cheap to make."""

    ended_at: float  # time.monotonic()
    seconds: float  # the step() call that landed this batch, scheduling to outputs
    budget: int  # max_num_batched_tokens when it was scheduled
    decode_tokens: int  # one per decoding request
    prefill_tokens: int  # prompt chunks (and recomputation after a preemption)
    spec_accepted: int  # proposed tokens the target kept
    spec_rejected: int
    num_preempted: int
    num_requests: int  # chunks in the batch


class StepLog:
    """The last `maxlen` steps; the engine calls `begin` and `land` only while it has one."""

    def __init__(self, maxlen: int = STEP_RECORDS) -> None:
        self.records: deque[StepRecord] = deque(maxlen=maxlen)
        self._started = time.perf_counter()
        self._budget = 0

    def begin(self, budget: int) -> None:
        self._started, self._budget = time.perf_counter(), budget

    def land(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        decode = proposed = accepted = 0
        for chunk in sched.chunks:
            if chunk.num_spec_tokens:
                proposed += chunk.num_spec_tokens
                accepted += max(0, len(sampled.get(chunk.request_id, ())) - 1)  # the last is the target's own
            if chunk.is_decode:
                decode += 1
        now = time.perf_counter()
        self.records.append(StepRecord(
            ended_at=time.monotonic(), seconds=now - self._started, budget=self._budget, decode_tokens=decode,
            prefill_tokens=sched.num_batched_tokens - decode - proposed, spec_accepted=accepted,
            spec_rejected=proposed - accepted, num_preempted=len(sched.preempted_request_ids),
            num_requests=len(sched.chunks)))


class RequestView(NamedTuple):
    """One request's numbers; a plain tuple, the cheapest thing to make on the engine thread."""

    request_id: str
    status: RequestStatus
    priority: int
    arrival_time: float  # time.monotonic()
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache when first admitted
    num_computed_tokens: int
    num_output_tokens: int
    max_tokens: int
    lora_request: LoRARequest | None


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine between two steps, immutable: safe to read from any thread."""

    seq: int  # 1, 2, ... per feed
    taken_at: float  # time.monotonic() on the engine thread
    num_blocks: int
    block_size: int
    sliding_windows: tuple[int | None, ...]  # one per KV group
    budget: int  # max_num_batched_tokens now
    max_num_seqs: int
    ref_counts: list[int]  # per block: how many block-table entries hold it (a copy: never changed)
    cached_blocks: list[int]  # blocks findable in the prefix cache (a block may repeat)
    # Every request holding blocks, with its tables (one per KV group; NULL_BLOCK where a sliding
    # window gave a block back): the ones running, and any that ended while their batch was in flight.
    holders: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]
    running: tuple[RequestView, ...]  # in the scheduler's order
    queued: tuple[RequestView, ...]  # the first MAX_QUEUED_SHOWN not running, in arrival order
    num_queued: int  # all of them
    stats: EngineStats
    steps: tuple[StepRecord, ...]

    @property
    def adapters_in_use(self) -> list[str]:
        """The LoRA adapters of the running batch, by name."""
        return sorted({v.lora_request.lora_name for v in self.running if v.lora_request is not None})


def take_snapshot(scheduler: Scheduler, stats: EngineStats, steps: StepLog | None, seq: int) -> EngineSnapshot:
    """Copy what the page shows; runs on the engine thread, between steps: list copies and a
    tuple per request, nothing per block in Python (50,000 blocks, 256 running: ~1 ms)."""
    kv = scheduler.kv_cache
    pool = kv.pool
    not_running = (r for r in scheduler.requests.values() if r.status is not RequestStatus.RUNNING)
    return EngineSnapshot(
        seq=seq, taken_at=time.monotonic(), num_blocks=pool.num_blocks, block_size=kv.block_size,
        sliding_windows=kv.sliding_windows, budget=scheduler.config.max_num_batched_tokens,
        max_num_seqs=scheduler.config.max_num_seqs, ref_counts=pool.ref_counts.copy(),
        cached_blocks=list(pool.cached.values()),
        holders=tuple((rid, tuple(tuple(t) if slots is None else () for t, slots in zip(tables, kv.state_slots)))
                      for rid, tables in kv.all_block_tables()),  # a hybrid's state slots are not blocks
        running=tuple(map(_view, scheduler.running)),
        queued=tuple(map(_view, itertools.islice(not_running, MAX_QUEUED_SHOWN))),
        num_queued=scheduler.num_waiting, stats=stats, steps=tuple(steps.records) if steps is not None else ())


def _view(r: Request) -> RequestView:
    return RequestView(r.request_id, r.status, r.priority, r.arrival_time, len(r.prompt_token_ids), r.num_cached_tokens,
                       r.num_computed_tokens, len(r.output_token_ids), r.max_tokens, r.lora_request)


class Watched(Protocol):
    """What the feed needs of an engine: its scheduler, and where its steps are recorded."""

    scheduler: Scheduler
    step_log: StepLog | None


class SnapshotFeed:
    """Between viewers (`ask`, any thread) and the engine thread (`serve`, between steps).

    Only references cross threads: a flag, and the latest snapshot, replaced whole."""

    def __init__(self, linger_s: float = LINGER_S, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.wanted = False
        self.latest: EngineSnapshot | None = None
        self.linger_s = linger_s
        self.min_interval_s = min_interval_s
        self._last_asked = 0.0
        self._seq = itertools.count(1)

    def ask(self) -> EngineSnapshot | None:
        """The latest snapshot (None before the first); a fresh one follows the next step if this
        one is `min_interval_s` old."""
        latest = self.latest
        self._last_asked = time.monotonic()
        if latest is None or self._last_asked - latest.taken_at >= self.min_interval_s:
            self.wanted = True
        return latest

    def serve(self, engine: Watched, stats: EngineStats) -> None:
        """After an engine iteration, on the engine thread: publish if asked, else (only while
        steps are being recorded) stop recording once nobody has looked for `linger_s`."""
        if not self.wanted:
            if engine.step_log is not None and time.monotonic() - self._last_asked > self.linger_s:
                engine.step_log = None
            return
        self.wanted = False  # first: an ask while this one is built asks for the next
        if engine.step_log is None:
            engine.step_log = StepLog()
        self.latest = take_snapshot(engine.scheduler, stats, engine.step_log, next(self._seq))


# -- the reader's side --------------------------------------------------------------------
@dataclass(frozen=True)
class TableEntries:
    """Every block table of a snapshot, end to end."""

    blocks: np.ndarray  # int64: the entries, table after table (NULL_BLOCK included)
    table: np.ndarray  # int64: the table each entry is in
    holder: np.ndarray  # int32: per table, its holder's index in snapshot.holders


@dataclass(frozen=True)
class KVGrid:
    """Per block, derived from a snapshot on the reader's thread."""

    state: np.ndarray  # uint8: FREE, CACHED_FREE, HELD, SHARED
    hashed: np.ndarray  # bool: findable in the prefix cache
    ref_counts: np.ndarray  # int64
    owner: np.ndarray  # int32: index in snapshot.holders of the first holder, -1 for none
    owners: dict[int, list[int]]  # block → every holder's index, for blocks with more than one
    unaccounted: list[int]  # blocks whose reference count is not the number of tables holding them
    entries: TableEntries

    def count(self, state: int) -> int:
        return int(np.count_nonzero(self.state == state))


def table_entries(snapshot: EngineSnapshot) -> TableEntries:
    tables = [table for _, groups in snapshot.holders for table in groups]
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    blocks = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lengths.sum()))
    holder = np.fromiter((i for i, (_, groups) in enumerate(snapshot.holders) for _ in groups), dtype=np.int32,
                         count=len(tables))
    return TableEntries(blocks, np.repeat(np.arange(len(tables)), lengths), holder)


def derive_grid(snapshot: EngineSnapshot) -> KVGrid:
    n = snapshot.num_blocks
    ref = np.fromiter(snapshot.ref_counts, dtype=np.int64, count=n)
    hashed = np.zeros(n, dtype=bool)
    hashed[np.fromiter(snapshot.cached_blocks, dtype=np.int64, count=len(snapshot.cached_blocks))] = True
    state = np.where(ref > 1, SHARED, np.where(ref == 1, HELD, np.where(hashed, CACHED_FREE, FREE))).astype(np.uint8)
    entries = table_entries(snapshot)
    live = entries.blocks != NULL_BLOCK
    blocks, holders = entries.blocks[live], entries.holder[entries.table[live]]
    held_by = np.bincount(blocks, minlength=n)
    owner = np.full(n, -1, dtype=np.int32)
    firsts, first_at = np.unique(blocks, return_index=True)  # a block's first holder, in holder order
    owner[firsts] = holders[first_at]
    return KVGrid(state, hashed, ref, owner, _several_owners(blocks, holders, held_by),
                  np.flatnonzero(held_by != ref).tolist(), entries)


def _several_owners(blocks: np.ndarray, holders: np.ndarray, held_by: np.ndarray) -> dict[int, list[int]]:
    shared = held_by[blocks] > 1
    if not shared.any():
        return {}
    blocks, holders = blocks[shared], holders[shared]
    order = np.argsort(blocks, kind="stable")  # stable: each block's holders stay in holder order
    blocks, holders = blocks[order], holders[order]
    starts = np.flatnonzero(np.concatenate(([True], blocks[1:] != blocks[:-1])))
    return {int(blocks[s]): group.tolist() for s, group in zip(starts, np.split(holders, starts[1:]))}
