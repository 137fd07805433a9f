"""`HostMemoryKVStore`: KV blocks in this process's memory, the first tier of KV offloading.

A bounded map from key to block, in exact least-recently-used order (a put, a lookup or a get
makes a block the most recently used). A put that would pass `max_bytes` evicts the least recently
used blocks first, then the batch's own from its end (its first blocks are a usable prefix without
the rest), as the directory store does. What it evicts is handed to `on_evict` (the tiered store
demotes it to the next tier), after the lock is released, so a slow lower tier never holds up a
lookup of this one.

A block is kept as bytes, or, with `pin_memory`, in a page-locked tensor: a CUDA engine then copies
it to the device without a staging copy. The engine thread (lookups) and the connector's I/O thread
(puts, gets) share a store: one lock guards the map, never held across a copy to another tier.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvflow.kv_store.base import Blob, KVBlockStore, check_keys

EvictedBlocks = list[tuple[bytes, Blob]]


class HostMemoryKVStore(KVBlockStore):
    def __init__(self, max_bytes: int, pin_memory: bool = False,
                 on_evict: Callable[[EvictedBlocks], None] | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"kv_offloading_size must be positive; got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.pin_memory = pin_memory
        self.on_evict = on_evict
        self.location = f"host memory of process {os.getpid()}"
        self._blocks: OrderedDict[bytes, Blob] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def lookup(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        with self._lock:
            for found, key in enumerate(keys):
                if key not in self._blocks:
                    return found
                self._blocks.move_to_end(key)
        return len(keys)

    def put(self, blocks: Sequence[tuple[bytes, Blob]]) -> int:
        """Keep each block (a copy: the caller's buffer may be reused), then evict past the bound."""
        check_keys([key for key, _ in blocks])
        fits = [memoryview(blob).nbytes <= self.max_bytes for _, blob in blocks]
        copies = [(key, self._copy(blob)) for (key, blob), fit in zip(blocks, fits) if fit]
        too_big = [block for block, fit in zip(blocks, fits) if not fit]  # straight to the next tier
        with self._lock:
            for key, blob in copies:
                if key in self._blocks:
                    self._pop(key)
                self._bytes += memoryview(blob).nbytes
                self._blocks[key] = blob
            batch = {key for key, _ in copies}
            evicted = self._evict(batch)
        if (evicted or too_big) and self.on_evict is not None:
            self.on_evict([*too_big, *evicted])
        return len(batch) - sum(key in batch for key, _ in evicted)

    def _evict(self, batch: set[bytes]) -> EvictedBlocks:
        """Under the lock: drop blocks until the bound holds, others before the batch's own, the
        batch's own from its end."""
        evicted: EvictedBlocks = []
        # The batch was just moved to the end: the least recently used others are at the front.
        while self._bytes > self.max_bytes and self._blocks and next(iter(self._blocks)) not in batch:
            evicted.append(self._pop(next(iter(self._blocks))))
        while self._bytes > self.max_bytes and self._blocks:
            evicted.append(self._pop(next(reversed(self._blocks))))
        return evicted

    def _pop(self, key: bytes) -> tuple[bytes, Blob]:
        blob = self._blocks.pop(key)
        self._bytes -= memoryview(blob).nbytes
        return key, blob

    def get(self, keys: Sequence[bytes]) -> list[Blob | None]:
        check_keys(keys)
        with self._lock:
            blobs = [self._blocks.get(key) for key in keys]
            for key, blob in zip(keys, blobs):
                if blob is not None:
                    self._blocks.move_to_end(key)
        return blobs

    def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        with self._lock:
            for key in keys:
                blob = self._blocks.pop(key, None)
                if blob is not None:
                    self._bytes -= memoryview(blob).nbytes

    def keys(self) -> list[bytes]:
        """Every key held, least recently used first (tests, inspection)."""
        with self._lock:
            return list(self._blocks)

    def _copy(self, blob: Blob) -> Blob:
        if not self.pin_memory:
            return bytes(blob)
        import numpy as np
        import torch

        data = np.frombuffer(blob, dtype=np.uint8)
        pinned = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
        pinned.numpy()[:] = data
        return memoryview(pinned.numpy())  # the array keeps the tensor, the view keeps the array
