"""The worker half of a KV connector: copies blocks between the KV pool and the transfer store.

The scheduler half (`kvflow.core.kv_connector`) says which blocks, under which keys; this half
moves the bytes. A block's bytes are its slice (dimension 1) of every distinct pool tensor, in
pool order, so a file holds exactly what one block of this layout holds, whatever the layers'
shapes (K/V, MLA latents, quantized codes with scales).

Saves write a temporary file and rename it into place: another process that sees the name sees
the whole block. A file of the wrong size (an engine with another model or dtype wrote it) is an
error, never silently loaded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from kvflow.core.kv_connector import KVConnectorMetadata, TransferStats, block_path
from kvflow.worker.kv_cache import unique_caches


class SharedStorageConnectorWorker:
    def __init__(self, path: str | os.PathLike, kv_caches: list[torch.Tensor]) -> None:
        self.path = Path(path)
        self.pools = unique_caches(kv_caches)
        self._pool_bytes = [p[:, 0].numel() * p.element_size() for p in self.pools]
        self.block_bytes = sum(self._pool_bytes)

    def load_kv(self, meta: KVConnectorMetadata, stats: dict[str, TransferStats]) -> None:
        """Before the forward pass: fill the loads' blocks from the store (one copy per pool tensor)."""
        started = time.perf_counter()
        data = torch.stack([self._read(t.key) for t in meta.loads]).to(self.pools[0].device)
        ids = torch.tensor([t.block_id for t in meta.loads], device=self.pools[0].device)
        offset = 0
        for pool, n in zip(self.pools, self._pool_bytes):
            rows = data[:, offset:offset + n].contiguous().view(pool.dtype).view(len(ids), *pool.shape[:1], *pool.shape[2:])
            pool.index_copy_(1, ids, rows.transpose(0, 1))  # an index_put here is ~30x slower on CPU
            offset += n
        self._record(meta.loads, time.perf_counter() - started, stats)

    def save_kv(self, meta: KVConnectorMetadata, stats: dict[str, TransferStats]) -> None:
        """After the forward pass: write the saves' blocks to the store (one gather per pool tensor)."""
        started = time.perf_counter()
        ids = torch.tensor([t.block_id for t in meta.saves], device=self.pools[0].device)
        rows = torch.cat([pool.index_select(1, ids).transpose(0, 1).reshape(len(ids), -1).view(torch.uint8) for pool in self.pools],
                         dim=1).cpu().numpy()
        for t, row in zip(meta.saves, rows):
            path = block_path(self.path, t.key)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            row.tofile(tmp)
            os.replace(tmp, path)
        self._record(meta.saves, time.perf_counter() - started, stats)

    def _read(self, key) -> torch.Tensor:
        path = block_path(self.path, key)
        data = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        if data.numel() != self.block_bytes:
            raise ValueError(f"KV transfer file {path} holds {data.numel()} bytes, not the {self.block_bytes} "
                             "of one block of this engine's KV layout (another model or dtype wrote it?)")
        return data

    def _record(self, transfers, seconds: float, stats: dict[str, TransferStats]) -> None:
        """The step's transfer time, shared among its requests by their blocks."""
        for t in transfers:
            stats.setdefault(t.request_id, TransferStats()).add(self.block_bytes, seconds / len(transfers))
