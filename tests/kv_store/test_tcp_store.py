"""The TCP block store's failure modes: a server that refuses malformed frames and keeps serving,
and a client that never hangs on a store that is down, silent or gone mid-run."""

from __future__ import annotations

import hashlib
import socket
import struct

import pytest

from kvflow.kv_store import KVStoreError, TCPKVStore, protocol
from kvflow.kv_store.tcp_server import KVStoreServer

KEY = hashlib.sha256(b"k").digest()


@pytest.fixture
def server():
    server = KVStoreServer("127.0.0.1", 0, max_bytes=1 << 20)
    server.start_thread()
    yield server
    server.stop()


def _raw(server: KVStoreServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    return sock


def _refused(sock: socket.socket) -> str:
    """The server's ERROR reply's message; it then closes the connection."""
    status, body = protocol.recv_frame(sock, 1 << 20)
    assert status == protocol.ERROR
    assert sock.recv(1) == b""  # closed
    return body.decode()


@pytest.mark.parametrize("frame, reason", [
    (struct.pack("!BQ", 99, 0), "unknown operation 99"),
    (struct.pack("!BQ", protocol.LOOKUP, 5) + b"12345", "multiple of 32"),
    (struct.pack("!BQ", protocol.GET, 1 << 62), "exceeds the limit"),
    (struct.pack("!BQ", protocol.PUT, 2) + b"\x00\x00", "block count"),
    (struct.pack("!BQ", protocol.PUT, 4) + struct.pack("!I", 1000), "index"),
    (struct.pack("!BQ", protocol.PUT, 4 + 40 + 3) + struct.pack("!I", 1) + KEY + struct.pack("!Q", 99) + b"abc",
     "do not add up"),
    (struct.pack("!BQ", protocol.STATS, 1) + b"x", "STATS frame with a body"),
])
def test_a_malformed_frame_is_refused_and_the_server_goes_on(server, frame, reason):
    client = TCPKVStore("127.0.0.1", server.port)
    client.put([(KEY, b"kept")])
    with _raw(server) as sock:
        sock.sendall(frame)
        assert reason in _refused(sock)
    with _raw(server) as sock:  # a frame cut short: the connection just ends
        sock.sendall(frame[:5])
    assert bytes(client.get([KEY])[0]) == b"kept"  # the store, and other connections, are untouched
    assert client.stats()[:2] == (4, 1)


def test_an_unreachable_store_fails_at_once_then_waits_before_trying_again():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = TCPKVStore("127.0.0.1", port, timeout_s=1.0, retry_after_s=60.0)
    with pytest.raises(KVStoreError, match=f"tcp://127.0.0.1:{port}"):
        client.lookup([KEY])
    with pytest.raises(KVStoreError, match="unreachable .next try in"):
        client.put([(KEY, b"x")])  # within retry_after_s: no second connection attempt


def test_a_silent_store_times_out():
    """A server that accepts connections but never answers: each call gives up after timeout_s."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # the kernel completes the handshake; nobody ever reads
        client = TCPKVStore("127.0.0.1", silent.getsockname()[1], timeout_s=0.2, retry_after_s=0.0)
        with pytest.raises(KVStoreError, match="timed out"):
            client.lookup([KEY])
        with pytest.raises(KVStoreError, match="timed out"):  # reconnects, and times out again
            client.get([KEY])


def test_a_store_that_stops_mid_run_is_an_error_and_one_that_returns_is_used_again():
    server = KVStoreServer("127.0.0.1", 0)
    server.start_thread()
    port = server.port
    client = TCPKVStore("127.0.0.1", port, timeout_s=2.0, retry_after_s=0.0)
    client.put([(KEY, b"x")])
    server.stop()  # cuts the client's open connection
    with pytest.raises(KVStoreError):
        client.lookup([KEY])
    again = KVStoreServer("127.0.0.1", port)
    again.start_thread()
    try:
        assert client.lookup([KEY]) == 0  # a new store: reconnected, empty
        client.put([(KEY, b"y")])
        assert bytes(client.get([KEY])[0]) == b"y"
    finally:
        again.stop()


def test_a_put_bigger_than_the_frame_limit_is_refused_as_a_whole(server, monkeypatch):
    monkeypatch.setattr(server, "max_frame_bytes", 1000)
    client = TCPKVStore("127.0.0.1", server.port, retry_after_s=0.0)
    with pytest.raises(KVStoreError):  # the refusal, or a reset if the server hung up before it was read
        client.put([(KEY, b"x" * 2000)])
    assert client.lookup([KEY]) == 0  # reconnected: the server goes on, and kept nothing
