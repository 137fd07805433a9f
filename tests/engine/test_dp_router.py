"""DPRouter alone (no processes): prefix affinity by chained block hashes, least-loaded otherwise,
deterministic ties, a bound on how far affinity may unbalance, dead replicas skipped and forgotten."""

from __future__ import annotations

import pytest

from kvflow.core.block_hash import extend_block_hashes
from kvflow.core.request import Request
from kvflow.engine.dp_router import DPRouter, ReplicaLoad
from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import SamplingParams

B = 4


def idle(n: int = 2) -> list[ReplicaLoad]:
    return [ReplicaLoad(True, 0, 0.0)] * n


def loads(*in_flight: int, usage: tuple[float, ...] | None = None, dead: tuple[int, ...] = ()) -> list[ReplicaLoad]:
    usage = usage or (0.0,) * len(in_flight)
    return [ReplicaLoad(i not in dead, n, u) for i, (n, u) in enumerate(zip(in_flight, usage))]


def test_hashes_are_the_prefix_caches_own_keys():
    router = DPRouter(B)
    lora = LoRARequest("a", 7, "/nowhere")
    request = Request("r", list(range(11)), SamplingParams(), 4, frozenset(), 0.0, cache_salt="s", lora_request=lora)
    expected: list[bytes] = []
    extend_block_hashes(expected, request.all_token_ids, B, request.cache_extra_keys)
    assert router.block_hashes(list(range(11)), "s", 7) == expected and len(expected) == 2
    assert router.block_hashes(list(range(11)), "t", 7) != expected  # another salt: another cache entry
    assert router.block_hashes([1, 2, 3]) == []  # no full block: nothing to be affine to


def test_a_shared_prefix_goes_where_its_first_request_went():
    router = DPRouter(B)
    system = list(range(40))
    first = router.route(router.block_hashes(system + [1, 2]), loads(1, 0))
    assert first == 1  # least loaded
    # The other replica is now less loaded, but the prefix lives on replica 1.
    assert router.route(router.block_hashes(system + [3, 4, 5]), loads(0, 1)) == 1
    assert router.prefix_hits == 1


def test_the_longest_remembered_prefix_wins():
    router = DPRouter(B)
    router.route(router.block_hashes(list(range(8))), loads(0, 1))  # 2 blocks → replica 0
    router.route(router.block_hashes(list(range(16))), loads(1, 0))  # its first 2 blocks say 0 …
    assert router.route(router.block_hashes(list(range(16)) + [99] * 4), loads(0, 0)) == 0
    router2 = DPRouter(B, max_imbalance=2)
    router2.route(router2.block_hashes(list(range(8))), loads(0, 1))
    router2.route(router2.block_hashes(list(range(8)) + list(range(100, 108))), loads(5, 0))  # too busy: 1
    assert router2.route(router2.block_hashes(list(range(8)) + list(range(100, 112))), loads(0, 0)) == 1


def test_unrelated_prompts_balance_by_queue_then_kv_usage_then_index():
    router = DPRouter(B)
    assert router.route([], loads(3, 1)) == 1
    assert router.route([], loads(2, 2, usage=(0.5, 0.2))) == 1
    assert router.route([], loads(2, 2, usage=(0.3, 0.3))) == 0  # a tie: the lowest index
    picks = []
    in_flight = [0, 0, 0]
    for i in range(9):  # distinct prompts on idle replicas spread evenly
        index = router.route(router.block_hashes([i] * 8), loads(*in_flight))
        in_flight[index] += 1
        picks.append(index)
    assert in_flight == [3, 3, 3] and picks[:3] == [0, 1, 2]


def test_affinity_yields_to_a_large_imbalance():
    router = DPRouter(B, max_imbalance=2)
    hashes = router.block_hashes(list(range(12)))
    assert router.route(hashes, loads(0, 0)) == 0
    assert router.route(hashes, loads(2, 0)) == 0  # within the slack
    assert router.route(hashes, loads(3, 0)) == 1  # beyond it: the least loaded, which now owns the prefix
    assert router.route(hashes, loads(0, 1)) == 1


def test_dead_replicas_are_skipped_and_forgotten():
    router = DPRouter(B)
    hashes = router.block_hashes(list(range(12)))
    assert router.route(hashes, loads(0, 1)) == 0
    assert router.route(hashes, loads(0, 0, dead=(0,))) == 1
    router.forget_replica(1)
    assert router.route(hashes, loads(0, 1)) == 0  # replica 1's entries are gone
    with pytest.raises(RuntimeError, match="no data-parallel replica is alive"):
        router.route(hashes, loads(0, 0, dead=(0, 1)))


def test_the_memory_of_hashes_is_bounded_lru():
    router = DPRouter(B, max_hashes=4)
    old = router.block_hashes(list(range(8)))
    router.route(old, loads(0, 1))  # 2 hashes → replica 0
    for i in range(4):
        router.route(router.block_hashes([100 + i] * 4), loads(0, 1))
    assert len(router._owner) == 4
    assert router.route(old, loads(1, 0)) == 1  # its hashes fell out: plain balancing
    with pytest.raises(ValueError, match="max_hashes"):
        DPRouter(B, max_hashes=0)
