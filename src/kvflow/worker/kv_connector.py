"""The worker half of a KV connector: copies blocks between the KV pool and the transfer store.

The scheduler half (`kvflow.core.kv_connector`) says which blocks, under which keys; this half
moves the bytes, in one store call per step for all of its loads and one for all of its saves. A
block's bytes are its slice (dimension 1) of every distinct pool tensor, in pool order, so a
stored block holds exactly what one block of this layout holds, whatever the layers' shapes (K/V,
MLA latents, quantized codes with scales).

A load can fail: the store lost a block since the scheduler's lookup, answers a block of the
wrong size (an engine with another model or dtype wrote it), or is unreachable. Then none of that
request's blocks are copied and `load_kv` names it: the runner discards what the step computes
for it and the scheduler has it compute its prompt (`Scheduler.recompute_failed_loads`). Its
blocks are its own (fresh ones, not yet findable in the prefix cache), so no other request sees
them. A failed save only means the consumer computes what it would have loaded.

Under tensor parallel every rank moves its own part of each block (its KV heads) under its own
key (`rank_key`), and the ranks agree on which loads failed (one all-reduce of a flag per load)
before anything is copied: a request whose part is missing on any rank recomputes on all of them.

`OffloadConnectorWorker` is KV offloading's half: saves written through to the tiers on an I/O
thread, loads fetched there into host memory while the steps go on, then copied into their
blocks before a later step's forward pass (`Worker` calls `begin_step`; the runner's own
`load_kv` call is for transfers only).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.core.kv_connector import BlockTransfer, KVConnectorMetadata, TransferStats, rank_key
from kvflow.distributed.parallel_state import SINGLE, TensorParallel
from kvflow.kv_store.base import KVBlockStore, KVStoreError, StoreFailureLog
from kvflow.worker.kv_cache import unique_caches

logger = logging.getLogger(__name__)


class KVStoreConnectorWorker:
    def __init__(self, store: KVBlockStore, kv_caches: list[torch.Tensor], tp: TensorParallel = SINGLE) -> None:
        self.store = store
        self.tp = tp
        self.pools = unique_caches(kv_caches)
        self._pool_bytes = [p[:, 0].numel() * p.element_size() for p in self.pools]
        self.block_bytes = sum(self._pool_bytes)
        self._failures = StoreFailureLog(logger)

    def load_kv(self, meta: KVConnectorMetadata, stats: dict[str, TransferStats]) -> set[str]:
        """Before the forward pass: fill the loads' blocks from the store (one copy per pool
        tensor). Returns the requests whose blocks could not all be loaded."""
        started = time.perf_counter()
        try:
            blobs = self.store.get([self._key(t) for t in meta.loads])
        except KVStoreError as e:
            self._failures.report("loading KV blocks", e)
            blobs = [None] * len(meta.loads)
        failed = {t.request_id for t, blob in zip(meta.loads, blobs) if blob is None}
        for t, blob in zip(meta.loads, blobs):
            if blob is not None and memoryview(blob).nbytes != self.block_bytes:
                logger.error("the KV store's block %s holds %d bytes, not the %d of one block of this engine's KV "
                             "layout (another model or dtype wrote it?): its request computes its prompt",
                             self._key(t).hex(), memoryview(blob).nbytes, self.block_bytes)
                failed.add(t.request_id)
        failed = self._agreed(meta, failed)
        loads = [(t, blob) for t, blob in zip(meta.loads, blobs) if t.request_id not in failed]
        if loads:
            self._copy_in(loads)
            self._record([t for t, _ in loads], time.perf_counter() - started, stats)
        return failed

    def _key(self, transfer: BlockTransfer) -> bytes:
        return rank_key(transfer.key, self.tp.rank, self.tp.size)

    def _agreed(self, meta: KVConnectorMetadata, failed: set[str]) -> set[str]:
        """The requests whose load failed on any rank (every rank the same set)."""
        if self.tp.size == 1:
            return failed
        requests = list(dict.fromkeys(t.request_id for t in meta.loads))
        flags = torch.tensor([r in failed for r in requests], dtype=torch.float32, device=self.pools[0].device)
        flags = self.tp.all_reduce(flags)
        return {r for r, flag in zip(requests, flags.tolist()) if flag > 0}

    def _copy_in(self, loads: list[tuple[BlockTransfer, object]]) -> None:
        staging = torch.empty((len(loads), self.block_bytes), dtype=torch.uint8)
        rows = staging.numpy()
        for row, (_, blob) in zip(rows, loads):
            row[:] = np.frombuffer(blob, dtype=np.uint8)
        device = self.pools[0].device
        data = staging.to(device)
        ids = torch.tensor([t.block_id for t, _ in loads], device=device)
        offset = 0
        for pool, n in zip(self.pools, self._pool_bytes):
            # As bytes: index_copy_ has no float8 kernel on CPU (fp8 KV caches, kv_quant.py), and a
            # block's bytes are all the store knows of it anyway.
            pool = pool.view(torch.uint8)
            rows = data[:, offset:offset + n].contiguous().view(len(ids), *pool.shape[:1], *pool.shape[2:])
            pool.index_copy_(1, ids, rows.transpose(0, 1))  # an index_put here is ~30x slower on CPU
            offset += n

    def begin_step(self, meta: KVConnectorMetadata | None, idle: bool, out) -> None:
        """Before the step, for loads that run beside the steps: a transfer's loads are in the step
        itself (`load_kv`), so nothing here."""

    def save_kv(self, meta: KVConnectorMetadata, stats: dict[str, TransferStats], skip: set[str] = frozenset()) -> None:
        """After the forward pass: write the saves' blocks to the store (one gather per pool tensor),
        but for requests in `skip` (their load failed: this step computed them on wrong KV)."""
        saves = [t for t in meta.saves if t.request_id not in skip]
        if not saves:
            return
        started = time.perf_counter()
        rows = self._gather(saves)
        try:
            self.store.put([(self._key(t), memoryview(row)) for t, row in zip(saves, rows)])
        except KVStoreError as e:
            self._failures.report("saving KV blocks", e)
            return
        self._record(saves, time.perf_counter() - started, stats)

    def _gather(self, transfers: list[BlockTransfer]) -> np.ndarray:
        """[blocks, block_bytes]: each block's slice of every pool tensor, in host memory."""
        ids = torch.tensor([t.block_id for t in transfers], device=self.pools[0].device)
        return torch.cat([pool.index_select(1, ids).transpose(0, 1).reshape(len(ids), -1).view(torch.uint8)
                          for pool in self.pools], dim=1).cpu().numpy()

    def _record(self, transfers: list[BlockTransfer], seconds: float, stats: dict[str, TransferStats]) -> None:
        """The step's transfer time, shared among its requests by their blocks."""
        for t in transfers:
            stats.setdefault(t.request_id, TransferStats()).add(self.block_bytes, seconds / len(transfers))


# An offloaded block: this header, then its bytes. The header names the block (its rank key) and
# its size, so a block read back under another key (a file renamed or corrupted, another program's
# value) or of another length is refused instead of being read as this prefix's KV.
BLOCK_MAGIC = b"KVFLOWB1"
HEADER_BYTES = len(BLOCK_MAGIC) + 32 + 8
# A step with nothing to run waits at most this long for a load to land before it returns (the
# engine then steps again): no busy loop while only loads are pending, no request kept waiting.
IDLE_WAIT_S = 0.05


@dataclass
class PendingLoad:
    """One request's asynchronous load: its transfers and the fetch running on the I/O thread."""

    transfers: list[BlockTransfer]
    future: Future
    started: float
    payloads: list[memoryview] = field(default_factory=list)  # each block's bytes, once checked


class StoreThread:
    """One daemon thread running store calls in order (a load queued after a save sees it). A
    call that hangs holds up only later calls (loads time out, saves are dropped past the
    backlog), never a step; a daemon thread never holds up the process's exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.backlog_bytes = 0  # saves queued and not yet written
        self._lock = threading.Lock()
        threading.Thread(target=_run_jobs, args=(self._jobs,), name="kvflow-kv-offload", daemon=True).start()
        weakref.finalize(self, self._jobs.put, None)  # the thread ends with its owner

    def submit(self, call, *args, backlog: int = 0) -> Future:
        future: Future = Future()
        with self._lock:
            self.backlog_bytes += backlog
        self._jobs.put((future, call, args, backlog, self))
        return future

    def done_with(self, backlog: int) -> None:
        with self._lock:
            self.backlog_bytes -= backlog


def _run_jobs(jobs: queue.SimpleQueue) -> None:
    """The I/O thread's loop. It holds no job while it waits for the next, so an owner dropped
    meanwhile is collected, and its finalizer's None ends the loop."""
    while (job := jobs.get()) is not None:
        _run_job(*job)
        del job


def _run_job(future: Future, call, args: tuple, backlog: int, owner: StoreThread) -> None:
    try:
        future.set_result(call(*args))
    except BaseException as e:  # noqa: BLE001 (handed to whoever waits for it)
        future.set_exception(e)
    finally:
        owner.done_with(backlog)


class OffloadConnectorWorker(KVStoreConnectorWorker):
    """KV offloading's worker half (`kvflow.core.kv_connector.OffloadConnector`): saves are
    written through to the tiers, loads run beside the steps.

    A save gathers the step's newly full blocks into host memory after the forward pass (the
    pool's blocks may be reused from the next step on) and queues the put on the I/O thread; a
    save that would queue behind more than `max_backlog_bytes` of earlier ones is dropped (its
    blocks are computed again if ever needed), so a slow tier never grows memory without bound.

    A load (`meta.fetches`) is a `get` on the I/O thread; the tiers bring the blocks into host
    memory. Before each step (`begin_step`), the loads whose bytes are all there and well formed
    are copied into their requests' blocks (one copy per pool tensor, no store call) and reported
    landed; a load that fails, holds a malformed block or outlasts `load_timeout_s` is reported
    failed (its request computes its prompt). Under tensor parallel the ranks agree first (one
    all-reduce of two flags per pending load): a load lands when it is ready on every rank, and
    fails when it failed on any. A cancelled load (its request preempted or ended) is dropped
    before anything is copied, so nothing is ever written into blocks the request gave back.
    """

    def __init__(self, store: KVBlockStore, kv_caches: list[torch.Tensor], tp: TensorParallel = SINGLE,
                 load_timeout_s: float = 30.0, max_backlog_bytes: int = 1 << 30) -> None:
        super().__init__(store, kv_caches, tp)
        self.load_timeout_s = load_timeout_s
        self.max_backlog_bytes = max_backlog_bytes
        self.io = StoreThread()
        self.pending: dict[str, PendingLoad] = {}
        self.num_saves_dropped = 0

    def save_kv(self, meta: KVConnectorMetadata, stats: dict[str, TransferStats], skip: set[str] = frozenset()) -> None:
        saves = [t for t in meta.saves if t.request_id not in skip]
        if not saves:
            return
        size = len(saves) * (HEADER_BYTES + self.block_bytes)
        if self.io.backlog_bytes and self.io.backlog_bytes + size > self.max_backlog_bytes:
            self.num_saves_dropped += len(saves)
            self._failures.report("offloading KV blocks", KVStoreError("the tiers are behind: blocks not saved"))
            return
        blocks = self._framed(saves, self._gather(saves))
        self.io.submit(self._put_quietly, blocks, backlog=size)

    def _framed(self, saves: list[BlockTransfer], rows: np.ndarray) -> list[tuple[bytes, memoryview]]:
        framed = np.empty((len(saves), HEADER_BYTES + self.block_bytes), dtype=np.uint8)
        framed[:, HEADER_BYTES:] = rows
        for row, transfer in zip(framed, saves):
            row[:HEADER_BYTES] = np.frombuffer(self._header(self._key(transfer)), dtype=np.uint8)
        return [(self._key(t), memoryview(row)) for t, row in zip(saves, framed)]

    def _header(self, key: bytes) -> bytes:
        return BLOCK_MAGIC + key + self.block_bytes.to_bytes(8, "little")

    def _put_quietly(self, blocks: list[tuple[bytes, memoryview]]) -> None:
        try:
            self.store.put(blocks)
        except KVStoreError as e:
            self._failures.report("offloading KV blocks", e)

    def begin_step(self, meta: KVConnectorMetadata | None, idle: bool, out) -> None:
        """Before the step: drop cancelled loads, start new ones, and copy in those that landed;
        into `out` (the step's ModelRunnerOutput) the landed loads' stats, marked `loaded`, and the
        failed requests. `idle`: the step runs nothing, so it may wait a little for a load."""
        if meta is not None:
            for request_id in meta.cancelled:
                self.pending.pop(request_id, None)
            self._start(meta.fetches)
        if not self.pending:
            return
        if idle:
            wait([load.future for load in self.pending.values()], timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        landed, failed = self._agreed_states()
        for request_id in failed:
            del self.pending[request_id]
        for request_id, stats in self._copy_landed(landed).items():
            out.kv_transfer[request_id] = stats
        out.kv_load_failed |= failed

    def _start(self, fetches: list[BlockTransfer]) -> None:
        by_request: dict[str, list[BlockTransfer]] = {}
        for transfer in fetches:
            by_request.setdefault(transfer.request_id, []).append(transfer)
        for request_id, transfers in by_request.items():
            future = self.io.submit(self.store.get, [self._key(t) for t in transfers])
            self.pending[request_id] = PendingLoad(transfers, future, time.perf_counter())

    def _state(self, request_id: str, load: PendingLoad) -> str:
        """"ready" (its payloads checked), "failed" or "pending"."""
        if not load.future.done():
            if time.perf_counter() - load.started <= self.load_timeout_s:
                return "pending"
            logger.warning("loading request %s's offloaded KV took over %.1f s: it computes its prompt",
                           request_id, self.load_timeout_s)
            return "failed"
        error = load.future.exception()
        if error is not None:
            self._failures.report("loading offloaded KV blocks", error)
            return "failed"
        payloads = [self._payload(t, blob) for t, blob in zip(load.transfers, load.future.result())]
        if any(p is None for p in payloads):
            return "failed"
        load.payloads = payloads
        return "ready"

    def _payload(self, transfer: BlockTransfer, blob) -> memoryview | None:
        """The block's bytes after its header, or None (missing, or not this block: logged)."""
        if blob is None:
            return None
        view = memoryview(blob).cast("B")
        key = self._key(transfer)
        if view.nbytes != HEADER_BYTES + self.block_bytes or bytes(view[:HEADER_BYTES]) != self._header(key):
            logger.error("the offloaded KV block %s is not one of this engine's blocks under that key (%d bytes, "
                         "header %r): refused, its request computes its prompt", key.hex(), view.nbytes,
                         bytes(view[:len(BLOCK_MAGIC)]))
            return None
        return view[HEADER_BYTES:]

    def _agreed_states(self) -> tuple[list[str], set[str]]:
        """(landed, failed) request ids, the same on every rank."""
        states = {request_id: self._state(request_id, load) for request_id, load in self.pending.items()}
        if self.tp.size > 1:
            flags = torch.tensor([[s == "failed", s == "pending"] for s in states.values()], dtype=torch.float32,
                                 device=self.pools[0].device)
            flags = self.tp.all_reduce(flags).tolist()
            states = {r: "failed" if f > 0 else "pending" if p > 0 else "ready"
                      for r, (f, p) in zip(states, flags)}
        return [r for r, s in states.items() if s == "ready"], {r for r, s in states.items() if s == "failed"}

    def _copy_landed(self, landed: list[str]) -> dict[str, TransferStats]:
        loads = [(t, payload) for r in landed for t, payload in zip(self.pending[r].transfers, self.pending[r].payloads)]
        if loads:
            self._copy_in(loads)
        stats = {}
        for request_id in landed:
            load = self.pending.pop(request_id)
            stats[request_id] = TransferStats(len(load.transfers) * self.block_bytes,
                                              time.perf_counter() - load.started, loaded=True)
        return stats
