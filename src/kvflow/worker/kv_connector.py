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
"""

from __future__ import annotations

import logging
import time

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

    def save_kv(self, meta: KVConnectorMetadata, stats: dict[str, TransferStats], skip: set[str] = frozenset()) -> None:
        """After the forward pass: write the saves' blocks to the store (one gather per pool tensor),
        but for requests in `skip` (their load failed: this step computed them on wrong KV)."""
        saves = [t for t in meta.saves if t.request_id not in skip]
        if not saves:
            return
        started = time.perf_counter()
        ids = torch.tensor([t.block_id for t in saves], device=self.pools[0].device)
        rows = torch.cat([pool.index_select(1, ids).transpose(0, 1).reshape(len(ids), -1).view(torch.uint8)
                          for pool in self.pools],
                         dim=1).cpu().numpy()
        try:
            self.store.put([(self._key(t), memoryview(row)) for t, row in zip(saves, rows)])
        except KVStoreError as e:
            self._failures.report("saving KV blocks", e)
            return
        self._record(saves, time.perf_counter() - started, stats)

    def _record(self, transfers: list[BlockTransfer], seconds: float, stats: dict[str, TransferStats]) -> None:
        """The step's transfer time, shared among its requests by their blocks."""
        for t in transfers:
            stats.setdefault(t.request_id, TransferStats()).add(self.block_bytes, seconds / len(transfers))
