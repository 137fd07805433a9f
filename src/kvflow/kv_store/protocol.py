"""The wire format of the TCP block store: length-prefixed binary frames, nothing executable.

Every message, either way, is a frame: a 9-byte header (one byte: the operation, or in a reply
the status; eight bytes: the body's length, big-endian) and the body. Keys are 32 bytes each, so
a list of keys is their concatenation. The bodies:

| op | request body | reply body (status OK) |
|---|---|---|
| LOOKUP | keys | u32: how many keys, from the first, are stored |
| PUT | u32 n, n × (key, u64 length), the n blocks' bytes | u32: how many were kept |
| GET | keys | n × u64 length (MISSING: gone), then the found blocks' bytes |
| DELETE | keys | empty |
| STATS | empty | u64 × 4: bytes held, blocks held, max bytes, blocks evicted so far |

A reply with status ERROR carries a UTF-8 message. A server that reads a malformed frame answers
ERROR and closes that connection (its framing can no longer be trusted); it keeps serving others.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

from kvflow.kv_store.base import KEY_BYTES, Blob

LOOKUP, PUT, GET, DELETE, STATS = 1, 2, 3, 4, 5
OPS = (LOOKUP, PUT, GET, DELETE, STATS)
OK, ERROR = 0, 1
MISSING = (1 << 64) - 1

HEADER = struct.Struct("!BQ")
COUNT = struct.Struct("!I")
PUT_ENTRY = struct.Struct(f"!{KEY_BYTES}sQ")
LENGTH = struct.Struct("!Q")
STATS_REPLY = struct.Struct("!4Q")
SMALL_FRAME = 64 << 10


class ProtocolError(ValueError):
    """A frame that does not follow the format above."""


def send_frame(sock: socket.socket, code: int, parts: Sequence[Blob]) -> None:
    """One frame whose body is `parts` concatenated. A small frame goes in one send (one packet,
    not a header alone); a big one part by part, so a block is never copied."""
    length = sum(memoryview(p).nbytes for p in parts)
    header = HEADER.pack(code, length)
    if length <= SMALL_FRAME:
        sock.sendall(b"".join([header, *parts]))
        return
    sock.sendall(header)
    for part in parts:
        sock.sendall(part)


def recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    """`n` bytes, or None if the peer closed the connection before the first of them."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        read = sock.recv_into(view[got:])
        if not read:
            if got == 0:
                return None
            raise ProtocolError(f"the connection closed {n - got} bytes into a {n}-byte read")
        got += read
    return buf


def recv_frame(sock: socket.socket, max_body: int) -> tuple[int, bytearray] | None:
    """(op or status, body); None at a clean end of the connection. A body longer than
    `max_body` is refused before anything is allocated for it."""
    header = recv_exact(sock, HEADER.size)
    if header is None:
        return None
    code, length = HEADER.unpack(header)
    if length > max_body:
        raise ProtocolError(f"a frame of {length} bytes exceeds the limit of {max_body}")
    body = recv_exact(sock, length) if length else bytearray()
    if body is None:
        raise ProtocolError("the connection closed between a frame's header and its body")
    return code, body


def split_keys(body: Blob) -> list[bytes]:
    body = memoryview(body)
    if body.nbytes % KEY_BYTES:
        raise ProtocolError(f"a list of keys is a multiple of {KEY_BYTES} bytes; got {body.nbytes}")
    return [bytes(body[i:i + KEY_BYTES]) for i in range(0, body.nbytes, KEY_BYTES)]


def encode_put(blocks: Sequence[tuple[bytes, Blob]]) -> list[Blob]:
    index = b"".join(PUT_ENTRY.pack(key, memoryview(data).nbytes) for key, data in blocks)
    return [COUNT.pack(len(blocks)), index, *(data for _, data in blocks)]


def decode_put(body: Blob) -> list[tuple[bytes, bytes]]:
    body = memoryview(body)
    if body.nbytes < COUNT.size:
        raise ProtocolError("a PUT body starts with its block count")
    (n,) = COUNT.unpack_from(body)
    offset = COUNT.size + n * PUT_ENTRY.size
    if offset > body.nbytes:
        raise ProtocolError(f"a PUT of {n} blocks needs {offset} bytes of index; the body has {body.nbytes}")
    entries = [PUT_ENTRY.unpack_from(body, COUNT.size + i * PUT_ENTRY.size) for i in range(n)]
    if offset + sum(length for _, length in entries) != body.nbytes:
        raise ProtocolError("a PUT's block lengths do not add up to its body")
    blocks = []
    for key, length in entries:
        blocks.append((key, bytes(body[offset:offset + length])))
        offset += length
    return blocks


def encode_get_reply(blocks: Sequence[bytes | None]) -> list[Blob]:
    lengths = b"".join(LENGTH.pack(MISSING if b is None else len(b)) for b in blocks)
    return [lengths, *(b for b in blocks if b is not None)]


def decode_get_reply(body: bytearray, num_keys: int) -> list[memoryview | None]:
    """The blocks are views of `body` (no copy)."""
    body = memoryview(body)
    offset = num_keys * LENGTH.size
    if offset > body.nbytes:
        raise ProtocolError(f"a GET reply for {num_keys} keys is too short")
    blocks: list[memoryview | None] = []
    for i in range(num_keys):
        (length,) = LENGTH.unpack_from(body, i * LENGTH.size)
        if length == MISSING:
            blocks.append(None)
            continue
        if offset + length > body.nbytes:
            raise ProtocolError("a GET reply's lengths overrun its body")
        blocks.append(body[offset:offset + length])
        offset += length
    return blocks
