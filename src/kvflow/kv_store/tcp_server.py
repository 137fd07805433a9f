"""`kvflow kv-store`: a block store in one process's memory, served over TCP to engines on any host.

`MemoryKVStore` keeps blocks in an LRU order (an OrderedDict: the front is the least recently
written, looked up or read) and evicts from the front when a put would pass `max_bytes`.
`KVStoreServer` serves it on a socket, one thread per connection (an engine holds one or two: its
scheduler's and its worker's), every call under one lock, so each batched call is atomic. Frames
are `kvflow.kv_store.protocol`'s; a malformed one gets an ERROR reply and its connection is
closed, and the server goes on.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvflow.kv_store import protocol
from kvflow.kv_store.base import Blob, KVBlockStore, check_keys
from kvflow.kv_transfer_config import DEFAULT_MAX_STORE_BYTES

logger = logging.getLogger(__name__)
# The largest frame a server reads: its bound plus room for a batch's index, and at least this much
# (a batch bigger than a small store is read, and what fits is kept).
MIN_FRAME_LIMIT = 64 << 20


class MemoryKVStore(KVBlockStore):
    def __init__(self, max_bytes: int = DEFAULT_MAX_STORE_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive; got {max_bytes}")
        self.location = f"memory:{id(self):x}"
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_evicted = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self) -> list[bytes]:
        """The stored keys, least recently used first."""
        with self._lock:
            return list(self._blocks)

    def lookup(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        with self._lock:
            for found, key in enumerate(keys):
                if key not in self._blocks:
                    return found
                self._blocks.move_to_end(key)
            return len(keys)

    def put(self, blocks: Sequence[tuple[bytes, Blob]]) -> int:
        """Evicts the least recently used blocks to make room, but never the batch's own: when
        only those are left, the rest of the batch is dropped (its first blocks are a prefix,
        useful without the rest; its last are useless without the first)."""
        check_keys([key for key, _ in blocks])
        batch: set[bytes] = set()
        with self._lock:
            for key, data in blocks:
                data = bytes(data)
                self._drop(key)
                while self.num_bytes + len(data) > self.max_bytes and self._blocks:
                    oldest = next(iter(self._blocks))
                    if oldest in batch:
                        break
                    self.num_bytes -= len(self._blocks.pop(oldest))
                    self.num_evicted += 1
                if self.num_bytes + len(data) > self.max_bytes:
                    continue
                self._blocks[key] = data
                self.num_bytes += len(data)
                batch.add(key)
        return len(batch)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        check_keys(keys)
        with self._lock:
            for key in keys:
                if key in self._blocks:
                    self._blocks.move_to_end(key)
            return [self._blocks.get(key) for key in keys]

    def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        with self._lock:
            for key in keys:
                self._drop(key)

    def _drop(self, key: bytes) -> None:
        old = self._blocks.pop(key, None)
        if old is not None:
            self.num_bytes -= len(old)

    def stats(self) -> tuple[int, int, int, int]:
        with self._lock:
            return self.num_bytes, len(self._blocks), self.max_bytes, self.num_evicted


class _Connection(socketserver.BaseRequestHandler):
    server: KVStoreServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        store = self.server.store
        self.server.track(sock, True)
        try:
            self._serve(sock, store)
        finally:
            self.server.track(sock, False)

    def _serve(self, sock: socket.socket, store: MemoryKVStore) -> None:
        while True:
            try:
                frame = protocol.recv_frame(sock, self.server.max_frame_bytes)
                if frame is None:
                    return
                protocol.send_frame(sock, protocol.OK, answer(store, *frame))
            except (protocol.ProtocolError, ValueError) as e:  # a bad frame: say why, then hang up
                logger.warning("kv-store: refused a malformed frame from %s: %s", self.client_address, e)
                _try_send(sock, protocol.ERROR, [str(e).encode()])
                return
            except OSError:  # the client went away
                return


def answer(store: MemoryKVStore, op: int, body: bytearray) -> list[Blob]:
    """The reply body to one request frame; ProtocolError for an unknown op or a malformed body."""
    if op == protocol.LOOKUP:
        return [protocol.COUNT.pack(store.lookup(protocol.split_keys(body)))]
    if op == protocol.PUT:
        return [protocol.COUNT.pack(store.put(protocol.decode_put(body)))]
    if op == protocol.GET:
        return protocol.encode_get_reply(store.get(protocol.split_keys(body)))
    if op == protocol.DELETE:
        store.delete(protocol.split_keys(body))
        return []
    if op == protocol.STATS and not body:
        return [protocol.STATS_REPLY.pack(*store.stats())]
    raise protocol.ProtocolError(f"unknown operation {op} (or a STATS frame with a body)")


def _try_send(sock: socket.socket, code: int, parts: list[Blob]) -> None:
    try:
        protocol.send_frame(sock, code, parts)
    except OSError:
        pass


class KVStoreServer(socketserver.ThreadingTCPServer):
    """`serve_forever()` answers until `shutdown()`; `port` is the bound one (0 asks for a free port)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, max_bytes: int = DEFAULT_MAX_STORE_BYTES) -> None:
        self.store = MemoryKVStore(max_bytes)
        self.max_frame_bytes = max(max_bytes, MIN_FRAME_LIMIT) + (1 << 20)
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__((host, port), _Connection)

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        return f"tcp://{self.server_address[0]}:{self.port}"

    def start_thread(self) -> threading.Thread:
        """Serve on a daemon thread (tests, `kvflow bench disagg --kv-store tcp`)."""
        thread = threading.Thread(target=self.serve_forever, args=(0.05,), name="kvflow-kv-store", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """Stop accepting and cut every open connection (its client sees the store go away)."""
        self.shutdown()
        self.server_close()
        with self._connections_lock:
            for sock in self._connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def track(self, sock: socket.socket, open_: bool) -> None:
        with self._connections_lock:
            (self._connections.add if open_ else self._connections.discard)(sock)
