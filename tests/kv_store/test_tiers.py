"""KV offloading's stores: the host-memory tier (exact LRU under a byte bound) and the tiered store
(host memory → disk → a shared store): blocks come back bit-identical from every tier, what a tier
evicts is demoted to the next, a get promotes to host memory, and a tier that fails is skipped
for its retry interval while the others keep answering."""

from __future__ import annotations

import hashlib
import os

import pytest
from redis_server import needs_redis, start_redis

from kvflow.kv_store import (
    DirectoryKVStore,
    HostMemoryKVStore,
    KVBlockStore,
    KVStoreError,
    RedisKVStore,
    TieredKVStore,
)

BLOCK = 256  # bytes per block in these tests


def _key(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def _block(i: int) -> bytes:
    """Bytes no other block has, covering every byte value (a bit flipped anywhere would show)."""
    return bytes((i * 7 + j) % 256 for j in range(BLOCK))


def _blocks(indices) -> list[tuple[bytes, bytes]]:
    return [(_key(i), _block(i)) for i in indices]


@pytest.fixture
def redis_url():
    server = start_redis()
    yield server.url
    server.stop()


def _tier(kind: str, tmp_path, request) -> KVBlockStore:
    if kind == "host":
        return HostMemoryKVStore(1 << 20)
    if kind == "disk":
        return DirectoryKVStore(tmp_path / "disk", 1 << 20)
    return RedisKVStore(request.getfixturevalue("redis_url"))


@pytest.mark.parametrize("kind", ["host", "disk", pytest.param("redis", marks=needs_redis)])
def test_each_tier_returns_blocks_bit_identical(kind, tmp_path, request):
    tier = _tier(kind, tmp_path, request)
    source = bytearray(_block(1))
    tier.put([(_key(1), memoryview(source)), (_key(2), _block(2))])
    source[:] = bytes(BLOCK)  # the caller's buffer is reused: the store kept its own copy
    assert [bytes(b) for b in tier.get([_key(1), _key(2)])] == [_block(1), _block(2)]
    assert tier.lookup([_key(1), _key(2), _key(3)]) == 2


def test_host_memory_evicts_exactly_the_least_recently_used_within_its_bytes():
    host = HostMemoryKVStore(3 * BLOCK)
    host.put(_blocks([0, 1, 2]))
    assert host.lookup([_key(0)]) == 1  # block 0 is now the most recently used, block 1 the least
    host.get([_key(2)])
    host.put(_blocks([3]))
    assert [b is not None for b in host.get([_key(i) for i in range(4)])] == [True, False, True, True]
    assert host.num_bytes == 3 * BLOCK


def test_host_memory_drops_a_batch_that_does_not_fit_from_its_end_and_hands_evictions_on():
    evicted = []
    host = HostMemoryKVStore(2 * BLOCK, on_evict=evicted.extend)
    host.put(_blocks([9]))
    assert host.put(_blocks([0, 1, 2])) == 2  # 9 goes first, then the batch's last block
    assert [key for key, _ in evicted] == [_key(9), _key(2)]
    assert [bytes(b) for _, b in evicted] == [_block(9), _block(2)]
    assert host.lookup([_key(0), _key(1)]) == 2


def _three_tiers(tmp_path, per_tier_blocks: int, bottom: KVBlockStore | None = None):
    host = HostMemoryKVStore(per_tier_blocks * BLOCK)
    disk = DirectoryKVStore(tmp_path / "disk", per_tier_blocks * BLOCK)
    shared = bottom or DirectoryKVStore(tmp_path / "shared", 1 << 20)
    return host, disk, shared, TieredKVStore([host, disk, shared])


def _held(tier: KVBlockStore, indices) -> list[int]:
    return [i for i, blob in zip(indices, tier.get([_key(i) for i in indices])) if blob is not None]


@pytest.mark.parametrize("bottom", ["directory", pytest.param("redis", marks=needs_redis)])
def test_what_a_tier_evicts_is_demoted_to_the_next_never_lost_while_one_has_room(bottom, tmp_path, request):
    shared = RedisKVStore(request.getfixturevalue("redis_url")) if bottom == "redis" else None
    host, disk, shared, tiered = _three_tiers(tmp_path, 2, shared)
    for i in range(6):  # one put per block: the oldest leave host memory first
        tiered.put(_blocks([i]))
    assert _held(host, range(6)) == [4, 5]
    assert _held(disk, range(6)) == [2, 3]
    assert _held(shared, range(6)) == [0, 1]
    assert tiered.lookup([_key(i) for i in range(6)]) == 6  # spread over three tiers, found whole
    assert [bytes(b) for b in tiered.get([_key(i) for i in range(6)])] == [_block(i) for i in range(6)]


def test_a_get_promotes_what_a_lower_tier_had_to_host_memory(tmp_path):
    host, disk, shared, tiered = _three_tiers(tmp_path, 2)
    for i in range(6):
        tiered.put(_blocks([i]))
    assert bytes(tiered.get([_key(0)])[0]) == _block(0)
    assert _key(0) in [key for key in (_key(i) for i in range(6)) if host.lookup([key])]
    assert bytes(host.get([_key(0)])[0]) == _block(0)


class BrokenTier(KVBlockStore):
    """A tier whose every call fails (a dead server), counting the calls it was asked."""

    location = "nowhere"

    def __init__(self) -> None:
        self.calls = 0

    def _fail(self, *args):
        self.calls += 1
        raise KVStoreError("the tier is down")

    lookup = put = get = delete = _fail


def test_a_failing_tier_is_skipped_for_its_retry_interval_and_the_others_answer(tmp_path):
    host = HostMemoryKVStore(1 * BLOCK)
    broken = BrokenTier()
    bottom = DirectoryKVStore(tmp_path / "bottom", 1 << 20)
    tiered = TieredKVStore([host, broken, bottom], retry_after_s=3600)
    tiered.put(_blocks([0]))
    tiered.put(_blocks([1]))  # block 0 leaves host memory: the broken tier fails, so it goes below
    assert broken.calls == 1
    assert _held(bottom, [0, 1]) == [0]
    assert tiered.lookup([_key(0), _key(1)]) == 2
    assert [bytes(b) for b in tiered.get([_key(0), _key(1)])] == [_block(0), _block(1)]
    tiered.delete([_key(0)])
    assert broken.calls == 1  # skipped ever since, not asked once per call


def test_a_dead_redis_tier_costs_one_timeout_then_is_skipped(tmp_path):
    """A Redis URL nothing listens on: the first call fails within its timeout, later ones at once."""
    host = HostMemoryKVStore(BLOCK)
    dead = RedisKVStore("redis://127.0.0.1:9/0", timeout_s=0.5, retry_after_s=3600)
    tiered = TieredKVStore([host, dead], retry_after_s=3600)
    for i in range(3):
        tiered.put(_blocks([i]))
    assert tiered.lookup([_key(2)]) == 1
    assert tiered.get([_key(0), _key(2)])[0] is None
    assert tiered._down_until[1] > 0 and tiered._down_until[0] == 0


def test_opening_the_tiers_names_the_flag_of_a_disk_path_that_cannot_be_made(tmp_path):
    from kvflow.kv_store import open_offload_store
    from kvflow.kv_transfer_config import KVOffloadConfig

    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    config = KVOffloadConfig.from_args(0.001, str(blocker / "disk"), 0.001, None)
    with pytest.raises(ValueError, match="kv_offloading_disk_path"):
        open_offload_store(config)
    assert not os.path.exists(blocker / "disk")


def test_a_block_larger_than_host_memory_goes_straight_to_the_next_tier(tmp_path):
    host = HostMemoryKVStore(BLOCK // 2)
    disk = DirectoryKVStore(tmp_path / "disk", 1 << 20)
    tiered = TieredKVStore([host, disk])
    tiered.put(_blocks([0]))
    assert host.num_bytes == 0 and _held(disk, [0]) == [0]
    assert bytes(tiered.get([_key(0)])[0]) == _block(0)
