"""`TieredKVStore`: KV offloading's tiers as one store — host memory, then a local disk directory,
then an optional shared store (a Redis server, or a directory several hosts share).

- A put goes to the first tier (host memory). What a tier evicts by its LRU bound is demoted to
  the next tier that is up (its `on_evict` hook, wired here), so a block is lost only when it falls
  off the last tier: never while a lower tier has room.
- A lookup counts the keys, from the first, found in any tier (a prompt's blocks may be spread:
  its oldest demoted to disk, its newest still in memory), one batched call per tier per run.
- A get searches tier by tier for what is still missing and promotes what a lower tier had to
  host memory (a copy stays below: a block read once is likely read again, and demoting it later
  then costs nothing but an overwrite).

A tier that fails (a dead Redis: `KVStoreError`) is skipped for `retry_after_s`, so it costs one
timeout per interval, never one per call; the others keep answering. The Redis store bounds each
call by its own timeout, so no call here hangs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

from kvflow.kv_store.base import Blob, KVBlockStore, KVStoreError, StoreFailureLog

logger = logging.getLogger(__name__)


class TieredKVStore(KVBlockStore):
    def __init__(self, tiers: Sequence[KVBlockStore], retry_after_s: float = 5.0) -> None:
        """`tiers`, fastest first. A tier with an `on_evict` attribute (host memory, a directory)
        has it set here to demote into the tiers below it."""
        if not tiers:
            raise ValueError("a tiered KV store needs at least one tier")
        self.tiers = list(tiers)
        self.location = " -> ".join(tier.location for tier in self.tiers)
        self.retry_after_s = retry_after_s
        self._down_until = [0.0] * len(self.tiers)
        self._failures = StoreFailureLog(logger)
        for index, tier in enumerate(self.tiers[:-1]):
            if hasattr(tier, "on_evict"):
                tier.on_evict = functools.partial(self._demote, below=index + 1)

    def _up(self, index: int) -> bool:
        return time.monotonic() >= self._down_until[index]

    def _call(self, index: int, method: str, argument, default):
        """Tier `index`'s `method(argument)`, or `default` if the tier is down or fails now (it is
        then skipped for `retry_after_s`)."""
        if not self._up(index):
            return default
        try:
            return getattr(self.tiers[index], method)(argument)
        except KVStoreError as e:
            self._down_until[index] = time.monotonic() + self.retry_after_s
            self._failures.report(f"{method} of KV blocks (tier {index}: {self.tiers[index].location})", e)
            return default

    def _put_from(self, first: int, blocks: Sequence[tuple[bytes, Blob]]) -> int:
        """Into the first tier from `first` that is up and takes them (one failing now is skipped)."""
        for index in range(first, len(self.tiers)):
            kept = self._call(index, "put", blocks, 0)
            if self._up(index):
                return kept
        return 0

    def _demote(self, blocks: list[tuple[bytes, Blob]], below: int) -> None:
        """Blocks tier `below - 1` evicted go to the next tier that takes them."""
        self._put_from(below, blocks)

    def lookup(self, keys: Sequence[bytes]) -> int:
        found = 0
        while found < len(keys):
            before = found
            for index in range(len(self.tiers)):
                found += self._call(index, "lookup", keys[found:], 0)
                if found == len(keys):
                    break
            if found == before:
                break
        return found

    def put(self, blocks: Sequence[tuple[bytes, Blob]]) -> int:
        """Into the first tier that takes them (host memory, which never fails); the bound demotes."""
        return self._put_from(0, blocks)

    def get(self, keys: Sequence[bytes]) -> list[Blob | None]:
        blobs: list[Blob | None] = [None] * len(keys)
        for index in range(len(self.tiers)):
            missing = [i for i, blob in enumerate(blobs) if blob is None]
            if not missing:
                break
            found = self._call(index, "get", [keys[i] for i in missing], [None] * len(missing))
            for i, blob in zip(missing, found):
                blobs[i] = blob
            promoted = [(keys[i], blob) for i, blob in zip(missing, found) if blob is not None]
            if index and promoted:
                self._call(0, "put", promoted, 0)
        return blobs

    def delete(self, keys: Sequence[bytes]) -> None:
        for index in range(len(self.tiers)):
            self._call(index, "delete", keys, None)
