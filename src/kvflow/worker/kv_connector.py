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
        self.block_bytes = sum(p[:, 0].numel() * p.element_size() for p in self.pools)

    def load_kv(self, meta: KVConnectorMetadata, stats: dict[str, TransferStats]) -> None:
        """Before the forward pass: fill the loads' blocks from the store."""
        for t in meta.loads:
            started = time.perf_counter()
            path = block_path(self.path, t.key)
            data = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
            if data.numel() != self.block_bytes:
                raise ValueError(f"KV transfer file {path} holds {data.numel()} bytes, not the {self.block_bytes} "
                                 "of one block of this engine's KV layout (another model or dtype wrote it?)")
            offset = 0
            for pool in self.pools:
                block = pool[:, t.block_id]
                n = block.numel() * block.element_size()
                block.copy_(data[offset:offset + n].view(pool.dtype).view(block.shape))
                offset += n
            stats.setdefault(t.request_id, TransferStats()).add(self.block_bytes, time.perf_counter() - started)

    def save_kv(self, meta: KVConnectorMetadata, stats: dict[str, TransferStats]) -> None:
        """After the forward pass: write the saves' blocks to the store."""
        for t in meta.saves:
            started = time.perf_counter()
            path = block_path(self.path, t.key)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                for pool in self.pools:
                    f.write(pool[:, t.block_id].contiguous().view(torch.uint8).cpu().numpy().tobytes())
            os.replace(tmp, path)
            stats.setdefault(t.request_id, TransferStats()).add(self.block_bytes, time.perf_counter() - started)
