"""`NamespacedStore`: a store seen through a namespace, so engines whose KV blocks differ never
read each other's.

A block hash names tokens (and a salt, an adapter), not the bytes computed from them: two engines
with another model, weights, dtype, KV dtype, block size or parallel layout store different bytes
under equal hashes. Blocks of another size are caught when loaded, but not those of equal size
(fp8 against int8 codes, bfloat16 against float16, a fine-tune of the same architecture): they
would be read as if they were this engine's. So every key is rehashed with a digest of what the
bytes depend on (`kv_store_namespace`, the engine's, and a user's namespace from
`kv_connector_extra_config.kv_store_namespace` before it), and a store holds each engine kind's
blocks apart, whatever the store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvflow.kv_store.base import Blob, KVBlockStore, check_keys


class NamespacedStore(KVBlockStore):
    def __init__(self, inner: KVBlockStore, namespace: str) -> None:
        self.inner = inner
        self.location = inner.location
        self.namespace = namespace
        self._digest = hashlib.sha256(namespace.encode()).digest()

    def stored_key(self, key: bytes) -> bytes:
        """The key `key` is kept under in the inner store."""
        return hashlib.sha256(self._digest + key).digest()

    def _keys(self, keys: Sequence[bytes]) -> list[bytes]:
        check_keys(keys)
        return [self.stored_key(k) for k in keys]

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self.inner.lookup(self._keys(keys))

    def put(self, blocks: Sequence[tuple[bytes, Blob]]) -> int:
        stored = self._keys([key for key, _ in blocks])
        return self.inner.put([(key, blob) for key, (_, blob) in zip(stored, blocks)])

    def get(self, keys: Sequence[bytes]) -> list[Blob | None]:
        return self.inner.get(self._keys(keys))

    def delete(self, keys: Sequence[bytes]) -> None:
        self.inner.delete(self._keys(keys))
