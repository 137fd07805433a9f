"""`KVBlockStore`: where KV blocks wait between the engine that computed them and the one that loads them.

Both halves of a KV connector talk to a store through four batched calls, each one round trip
whatever the number of blocks (a remote store pays its latency once per call, not per block):

- `lookup(keys)`: how many of `keys`, from the first, are stored (a prefix, because a block is
  only useful after every block before it); the found blocks count as just used;
- `put(blocks)`: store (key, bytes) pairs; a bounded store evicts its least recently used blocks
  to make room, and may drop what does not fit;
- `get(keys)`: the bytes of each key, None for one that is gone (evicted, deleted);
- `delete(keys)`: forget them; a missing key is no error.

Keys are the prefix cache's chained block hashes (32-byte SHA-256 digests), so equal keys mean
equal prefixes whoever computed them. A store knows nothing of tensors: a block is opaque bytes.

Every call may raise `KVStoreError` (the store is unreachable, timed out, or answered nonsense);
the connector halves catch it and fall back to computing (see `kvflow.core.kv_connector`).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

KEY_BYTES = 32  # a SHA-256 block hash
Blob = bytes | bytearray | memoryview  # a block's bytes, or a view of them (no copy on the way out)


class KVStoreError(OSError):
    """The store could not answer: unreachable, timed out, or a malformed reply."""


class KVBlockStore(ABC):
    #: what two engines must name alike to share blocks (a directory, a redis:// URL)
    location: str

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are stored; each found one counts as just used."""

    @abstractmethod
    def put(self, blocks: Sequence[tuple[bytes, Blob]]) -> int:
        """Store each (key, bytes); returns how many were kept (a bounded store may drop some)."""

    @abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[Blob | None]:
        """Each key's bytes, or None where the store no longer has it."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> None:
        """Forget `keys` (missing ones are ignored)."""


def check_keys(keys: Sequence[bytes]) -> None:
    """Keys are whole block hashes: anything else is a caller's bug, named before it goes anywhere."""
    for key in keys:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"a KV store key is a {KEY_BYTES}-byte block hash; got {key!r:.80}")


class StoreFailureLog:
    """Warns of a store's failures at most once per `every_s` seconds: a store that is down fails
    every step, and one line says so as well as a thousand."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger, self.every_s = logger, every_s
        self.num_failures = 0
        self._last = -float("inf")

    def report(self, doing: str, error: Exception) -> None:
        self.num_failures += 1
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self.logger.warning("KV store failure while %s (%d so far; the prompt is computed instead): %s",
                                doing, self.num_failures, error)
