"""`RedisKVStore`: KV blocks in a Redis server, for engines on different hosts.

Redis is the store people already run, monitor and size: its `maxmemory` with
`maxmemory-policy allkeys-lru` is the bound (Redis evicts approximately least recently used keys;
kvflow's own stores evict exactly). A block is one string value under its 32-byte key (binary,
prefixed with `kvflow:` so a shared instance can tell kvflow's keys from others'; the key is already
namespaced by the engine's KV kind: `kvflow.kv_store.namespaced`). Each batched call is one round
trip (a pipeline, or MGET / UNLINK).

Nothing here may hang an engine: the connection and every reply have a timeout (`timeout_s`), and
after a failure the store counts as down for `retry_after_s` (calls fail at once instead of each
waiting out a timeout), then one call tries again. Every failure is a `KVStoreError`, which the
connector halves turn into computing locally. A reply that is not what was asked for (a value that
is not bytes: another program wrote the key) is an error, never a block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvflow.kv_store.base import Blob, KVBlockStore, KVStoreError, check_keys

KEY_PREFIX = b"kvflow:"


class RedisKVStore(KVBlockStore):
    def __init__(self, url: str, timeout_s: float = 5.0, retry_after_s: float = 5.0) -> None:
        """`url`: redis://[:password@]host:port[/db] (rediss:// for TLS)."""
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ValueError("kv_connector RedisStoreConnector needs the redis client: pip install redis") from None
        # No retries of its own: a failure is reported at once and the store counts as down.
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0))
        kwargs = self._client.connection_pool.connection_kwargs
        self.location = f"redis://{kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"  # no password
        self.retry_after_s = retry_after_s
        self._errors = (redis.RedisError, OSError)
        self._down_until = 0.0
        self._lock = threading.Lock()

    def lookup(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        if not keys:
            return 0

        def run(client):
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(KEY_PREFIX + key)
            pipe.touch(*(KEY_PREFIX + k for k in keys))  # the found ones count as just used
            return pipe.execute()

        found = self._call("lookup", run)[:-1]
        return next((i for i, hit in enumerate(found) if not hit), len(keys))

    def put(self, blocks: Sequence[tuple[bytes, Blob]]) -> int:
        check_keys([key for key, _ in blocks])
        if not blocks:
            return 0

        def run(client):
            pipe = client.pipeline(transaction=False)
            for key, blob in blocks:
                pipe.set(KEY_PREFIX + key, bytes(blob))
            return pipe.execute(raise_on_error=False)

        return sum(reply is True for reply in self._call("put", run))  # an OOM refusal is a block not kept

    def get(self, keys: Sequence[bytes]) -> list[Blob | None]:
        check_keys(keys)
        if not keys:
            return []
        values = self._call("get", lambda client: client.mget([KEY_PREFIX + k for k in keys]))
        if len(values) != len(keys) or any(v is not None and not isinstance(v, bytes) for v in values):
            raise KVStoreError(f"the KV store at {self.location} answered a malformed MGET")
        return values

    def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        if keys:
            self._call("delete", lambda client: client.unlink(*(KEY_PREFIX + k for k in keys)))

    def keys(self) -> list[bytes]:
        """Every kvflow block key the server holds (tests, inspection)."""
        return sorted(k[len(KEY_PREFIX):] for k in self._call("scan", lambda c: list(c.scan_iter(KEY_PREFIX + b"*"))))

    def close(self) -> None:
        self._client.close()

    def _call(self, what: str, run):
        with self._lock:
            now = time.monotonic()
            if now < self._down_until:
                raise KVStoreError(f"the KV store at {self.location} is unreachable "
                                   f"(next try in {self._down_until - now:.1f} s)")
            try:
                return run(self._client)
            except self._errors as e:
                self._client.connection_pool.disconnect()
                self._down_until = now + self.retry_after_s
                raise KVStoreError(f"the KV store at {self.location} failed ({what}): "
                                   f"{str(e) or type(e).__name__}") from None
