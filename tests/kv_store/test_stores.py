"""The `KVBlockStore` contract, kept alike by the directory store and a Redis server's: prefix
lookups, batched put / get / delete; and, for the directory, a size bound that evicts exactly the
least recently written or used blocks (Redis' bound is its maxmemory, evicting approximately)."""

from __future__ import annotations

import hashlib
import time

import pytest
from redis_server import needs_redis, start_redis

from kvflow.kv_store import DirectoryKVStore, KVStoreError, RedisKVStore

BLOCK = 100  # bytes per block in these tests


def _key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def _block(name: str) -> bytes:
    return (name.encode() * BLOCK)[:BLOCK]


def _store_factory(kind: str, tmp_path, servers: list):
    """A factory of an empty store of the kind, bounded to `max_bytes`."""

    def make(max_bytes: int = 1 << 20):
        if kind == "directory":
            return DirectoryKVStore(tmp_path / f"store{len(servers)}", max_bytes)
        servers.append(start_redis())
        return RedisKVStore(servers[-1].url, timeout_s=5.0)

    return make


@pytest.fixture(params=["directory", pytest.param("redis", marks=needs_redis)])
def any_store(request, tmp_path):
    servers = []
    yield _store_factory(request.param, tmp_path, servers)
    for server in servers:
        server.stop()


@pytest.fixture
def make_store(tmp_path):
    """The directory store, whose bound is exact."""
    yield _store_factory("directory", tmp_path, [])


def _settle() -> None:
    """Directory stores order blocks by file time, which the kernel keeps at a few ms' grain."""
    time.sleep(0.02)


def test_lookup_counts_the_stored_prefix_and_get_returns_the_bytes(any_store):
    store = any_store()
    keys = [_key(n) for n in "abcd"]
    assert store.lookup(keys) == 0
    assert store.put([(_key("a"), _block("a")), (_key("b"), memoryview(_block("b"))), (_key("d"), _block("d"))]) == 3
    assert store.lookup(keys) == 2  # c is missing: d after it is of no use
    assert store.lookup(keys[3:]) == 1
    assert store.lookup([]) == 0
    got = store.get([_key("b"), _key("c"), _key("a")])
    assert [None if g is None else bytes(g) for g in got] == [_block("b"), None, _block("a")]
    store.put([(_key("b"), _block("B"))])  # a second put replaces
    assert bytes(store.get([_key("b")])[0]) == _block("B")
    store.delete([_key("a"), _key("c")])  # a missing key is no error
    assert store.lookup(keys) == 0 and store.lookup(keys[1:2]) == 1
    store.delete([_key("b"), _key("d")])
    assert store.get(keys) == [None] * 4


def test_the_bound_evicts_the_least_recently_written_or_used(make_store):
    store = make_store(max_bytes=3 * BLOCK)
    for name in "abc":
        store.put([(_key(name), _block(name))])
        _settle()
    assert store.get([_key("a")])[0] is not None  # a is now the most recently used
    _settle()
    store.put([(_key("d"), _block("d"))])
    _settle()
    assert store.lookup([_key("b")]) == 0  # over the bound: b, the least recently used, went
    assert store.lookup([_key("c")]) == 1  # a lookup is a use too: now a is the least recently used
    _settle()
    store.put([(_key("e"), _block("e"))])
    assert [store.lookup([_key(n)]) for n in "acde"] == [0, 1, 1, 1]


def test_a_block_bigger_than_the_bound_is_not_kept(make_store):
    store = make_store(max_bytes=BLOCK)
    assert store.put([(_key("big"), b"x" * (BLOCK + 1)), (_key("a"), _block("a"))]) == 1
    assert store.lookup([_key("big")]) == 0 and store.lookup([_key("a")]) == 1


def test_a_batch_bigger_than_the_bound_keeps_its_first_blocks(make_store):
    """A prompt's blocks are a chain: its first ones are useful without the rest, not the reverse."""
    store = make_store(max_bytes=3 * BLOCK)
    store.put([(_key("old"), _block("old"))])
    _settle()
    batch = [(_key(n), _block(n)) for n in "abcde"]
    assert store.put(batch) == 3
    assert store.lookup([key for key, _ in batch]) == 3  # a, b, c
    assert store.lookup([_key("old")]) == 0 and store.lookup([_key("d")]) == 0 and store.lookup([_key("e")]) == 0


def test_keys_must_be_block_hashes(any_store):
    store = any_store()
    with pytest.raises(ValueError, match="32-byte block hash"):
        store.lookup([b"short"])
    with pytest.raises(ValueError, match="32-byte block hash"):
        store.put([("a" * 32, b"x")])


def test_engines_sharing_a_directory_share_its_blocks_and_its_bound(tmp_path):
    """Two stores on one directory (a prefill and a decode engine): what one writes the other
    finds; eviction by either keeps the directory within the bound, oldest first."""
    writer, reader = DirectoryKVStore(tmp_path, 4 * BLOCK), DirectoryKVStore(tmp_path, 4 * BLOCK)
    assert writer.location == reader.location
    for name in "abcdef":
        writer.put([(_key(name), _block(name))])
        _settle()
    assert [reader.lookup([_key(n)]) for n in "abcdef"] == [0, 0, 1, 1, 1, 1]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) == 4 * BLOCK
    assert all(p.suffix == ".kv" for p in tmp_path.iterdir())  # no temporary file left behind


@needs_redis
def test_a_redis_store_that_dies_fails_fast_and_a_foreign_value_is_no_block():
    server = start_redis()
    store = RedisKVStore(server.url, timeout_s=2.0, retry_after_s=60.0)
    store.put([(_key("a"), _block("a"))])
    import redis  # another program writes a kvflow key with a value that is not a string

    other = redis.Redis(port=server.port)
    other.rpush(b"kvflow:" + _key("b"), b"x")
    assert store.get([_key("b"), _key("a")])[0] is None  # not a string: no block (the request computes)
    server.stop()
    started = time.monotonic()
    with pytest.raises(KVStoreError, match="unreachable|failed"):
        store.lookup([_key("a")])
    with pytest.raises(KVStoreError, match="unreachable"):  # down: at once, no second wait
        store.get([_key("a")])
    assert time.monotonic() - started < 5
