"""`TCPKVStore`: the block store of a `kvflow kv-store` server, for engines on different hosts.

One persistent connection, opened on first use; each batched call is one request frame and one
reply (`kvflow.kv_store.protocol`). Nothing here may hang an engine: every socket operation has a
timeout (`timeout_s`, no progress for that long is a failure), and after a failure the store is
treated as down for `retry_after_s` (calls fail at once instead of each waiting out a timeout),
then one call tries to reconnect. Every failure is a `KVStoreError`, which the connector halves
turn into computing locally.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

import kvflow.kv_store.protocol as protocol
from kvflow.kv_store.base import Blob, KVBlockStore, KVStoreError, check_keys

MAX_REPLY_BYTES = 16 << 30  # the server is trusted to answer what it was asked; this only bounds nonsense


class TCPKVStore(KVBlockStore):
    def __init__(self, host: str, port: int, timeout_s: float = 5.0, retry_after_s: float = 5.0) -> None:
        self.host, self.port = host, port
        self.location = f"tcp://{host}:{port}"
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._sock: socket.socket | None = None
        self._down_until = 0.0  # time.monotonic() before which the store counts as down
        self._lock = threading.Lock()

    def lookup(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        if not keys:
            return 0
        return self._count(self._call(protocol.LOOKUP, [b"".join(keys)]))

    def put(self, blocks: Sequence[tuple[bytes, Blob]]) -> int:
        check_keys([key for key, _ in blocks])
        if not blocks:
            return 0
        return self._count(self._call(protocol.PUT, protocol.encode_put(blocks)))

    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        check_keys(keys)
        if not keys:
            return []
        body = self._call(protocol.GET, [b"".join(keys)])
        try:
            return protocol.decode_get_reply(body, len(keys))
        except protocol.ProtocolError as e:
            self.close()
            raise KVStoreError(f"the KV store at {self.location} answered a malformed GET: {e}") from None

    def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        if keys:
            self._call(protocol.DELETE, [b"".join(keys)])

    def stats(self) -> tuple[int, int, int, int]:
        """(bytes held, blocks held, max bytes, blocks evicted so far) of the whole store."""
        return protocol.STATS_REPLY.unpack(self._call(protocol.STATS, []))

    def close(self) -> None:
        with self._lock:
            self._disconnect()

    def _call(self, op: int, parts: list[Blob]) -> bytearray:
        """Send one request frame and read its reply's body (status OK), else raise KVStoreError."""
        with self._lock:
            now = time.monotonic()
            if self._sock is None and now < self._down_until:
                raise KVStoreError(f"the KV store at {self.location} is unreachable "
                                   f"(next try in {self._down_until - now:.1f} s)")
            try:
                if self._sock is None:
                    self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
                    self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                protocol.send_frame(self._sock, op, parts)
                frame = protocol.recv_frame(self._sock, MAX_REPLY_BYTES)
                if frame is None:
                    raise KVStoreError("it closed the connection")
            except (OSError, protocol.ProtocolError) as e:
                self._disconnect()
                self._down_until = now + self.retry_after_s
                raise KVStoreError(f"the KV store at {self.location} failed: {str(e) or type(e).__name__}") from None
            status, body = frame
            if status != protocol.OK:  # the server hangs up after refusing a frame
                self._disconnect()
                raise KVStoreError(f"the KV store at {self.location} refused a request: "
                                   f"{bytes(body).decode(errors='replace')}")
            return body

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _count(self, body: bytearray) -> int:
        if len(body) != protocol.COUNT.size:
            self.close()
            raise KVStoreError(f"the KV store at {self.location} answered a {len(body)}-byte count")
        return protocol.COUNT.unpack(body)[0]
