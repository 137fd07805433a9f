"""Disaggregated prefill/decode when the KV store does not deliver: a size bound evicted blocks,
a block vanished between the lookup and the load, or the store is down or silent. Each time the
decode engine computes what it did not get, its outputs equal one engine's, and nothing leaks."""

from __future__ import annotations

import socket

import pytest
from disagg_stores import (  # noqa: F401  (fixtures)
    GREEDY,
    B,
    assert_same,
    make_engine,
    make_exactly_bounded_store,
    make_pair,
    make_store,
    model_dir,
    random_tokens,
    reference,
    store,
)
from redis_server import needs_redis, start_redis

from kvflow.core.kv_connector import transfer_keys
from kvflow.engine.disaggregated import DisaggregatedPrefillDecode
from kvflow.sampling_params import RequestOutputKind, SamplingParams

SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, logprobs=2,
                        output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def block_bytes(model_dir, tmp_path_factory) -> int:
    return make_engine(model_dir, "kv_both", tmp_path_factory.mktemp("probe")).runner.kv_connector.block_bytes


def _assert_baseline(*engines) -> None:
    for engine in engines:
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.kv_cache.pool.num_free_blocks == engine.num_kv_blocks


def _prefill(pair, request_id: str, prompt: list[int]) -> None:
    pair.add_prefill(request_id, {"prompt_token_ids": prompt})
    while not pair.step_prefill():
        pass


def _decode(pair, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict:
    for request_id, prompt in prompts.items():
        pair.add_decode(request_id, {"prompt_token_ids": prompt}, params)
    done = {}
    while pair.decode.has_unfinished_requests():
        done.update((o.request_id, o) for o in pair.step_decode() if o.finished)
    return done


def test_the_bound_evicts_the_least_recently_used_and_the_consumer_computes_them(model_dir, make_exactly_bounded_store,
                                                                               block_bytes):
    store = make_exactly_bounded_store(max_bytes=4 * block_bytes)
    pair = make_pair(model_dir, store)
    first, second = random_tokens(100, seed=1), random_tokens(2 * B + 1, seed=2)  # 13 blocks to save; 2
    _prefill(pair, "first", first)  # the store keeps first's 4 leading blocks: a prefix, still of use
    _prefill(pair, "second", second)  # ... until second's 2 evict the 2 least recently used: first's 0 and 1
    assert len(store.contents()) == 4
    done = _decode(pair, {"first": first, "second": second})
    for rid, ref in zip(("first", "second"), reference(model_dir, [first, second])):
        assert_same(done[rid], ref)
    assert done["first"].num_cached_tokens == 0 and done["first"].metrics.kv_transfer_bytes == 0
    assert done["second"].num_cached_tokens == 2 * B and done["second"].metrics.kv_transfer_bytes == 2 * block_bytes
    assert store.contents() == []
    _assert_baseline(pair.prefill, pair.decode)


def test_a_block_lost_between_lookup_and_load_fails_that_load_and_the_request_computes(model_dir, make_store,
                                                                                       monkeypatch):
    store = make_store()
    pair = make_pair(model_dir, store)
    lost, kept = random_tokens(3 * B + 2, seed=4), random_tokens(2 * B + 3, seed=5)
    connector = pair.decode.scheduler.kv_connector
    allocated = connector.update_state_after_alloc

    def lose_a_block(request, *args):  # after the lookup found every block, before the worker loads them
        allocated(request, *args)
        if request.prompt_token_ids == lost:
            connector.store.delete([transfer_keys(lost, B)[1][0]])

    monkeypatch.setattr(connector, "update_state_after_alloc", lose_a_block)
    _prefill(pair, "lost", lost)
    _prefill(pair, "kept", kept)
    # Both admitted, and loaded, in one step. Seeded sampling: the failed step drew from `lost`'s
    # generator, which must start again from its seed.
    done = _decode(pair, {"lost": lost, "kept": kept}, SEEDED)
    refs = reference(model_dir, [lost, kept], SEEDED)
    assert_same(done["lost"], refs[0])
    assert done["lost"].num_cached_tokens == 0 and done["lost"].metrics.kv_transfer_bytes == 0
    assert_same(done["kept"], refs[1])  # the other request of the step is untouched
    assert done["kept"].num_cached_tokens == len(kept) - 1
    assert store.contents() == []
    _assert_baseline(pair.prefill, pair.decode)
    # What the decode engine's prefix cache holds for `lost` is what it computed, not the half-load.
    again = pair.generate([{"prompt_token_ids": lost}], SEEDED)[0]
    assert_same(again, refs[0])
    assert again.num_cached_tokens == len(lost) - 1 and again.metrics.kv_transfer_bytes == 0


def test_a_block_of_the_wrong_size_is_not_loaded(model_dir, store):
    """Another model or KV dtype wrote it under the same key: never copied into the pool."""
    pair = make_pair(model_dir, store)
    prompt = random_tokens(2 * B + 3, seed=8)
    _prefill(pair, "r", prompt)
    pair.decode.scheduler.kv_connector.store.put([(transfer_keys(prompt, B)[1][0], b"another model's block")])
    done = _decode(pair, {"r": prompt})
    assert_same(done["r"], reference(model_dir, [prompt])[0])
    assert done["r"].num_cached_tokens == 0 and done["r"].metrics.kv_transfer_bytes == 0
    assert store.contents() == []
    _assert_baseline(pair.prefill, pair.decode)


def _redis_pair(model_dir, url: str, timeout_s: float) -> DisaggregatedPrefillDecode:
    extra = {"kv_connector": "RedisStoreConnector",
             "kv_connector_extra_config": {"kv_store_url": url, "kv_store_timeout_s": timeout_s}}
    return DisaggregatedPrefillDecode(make_engine(model_dir, kv_transfer_config={"kv_role": "kv_producer", **extra}),
                                      make_engine(model_dir, kv_transfer_config={"kv_role": "kv_consumer", **extra}))


@needs_redis
def test_a_store_that_goes_away_after_the_prefill_means_computing_here(model_dir):
    server = start_redis()
    pair = _redis_pair(model_dir, server.url, timeout_s=2.0)
    prompts = {"a": random_tokens(B + 1, seed=6), "b": random_tokens(3 * B, seed=7)}
    for rid, prompt in prompts.items():
        _prefill(pair, rid, prompt)
    assert pair.decode.scheduler.kv_connector.store.lookup([transfer_keys(prompts["b"], B)[0][0]]) == 1
    server.stop()  # with the prompts' KV in it
    done = _decode(pair, prompts)
    for rid, ref in zip(prompts, reference(model_dir, list(prompts.values()))):
        assert_same(done[rid], ref)
        assert done[rid].num_cached_tokens == 0
    _assert_baseline(pair.prefill, pair.decode)


def test_a_silent_store_costs_a_timeout_not_a_hang(model_dir):
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        pair = _redis_pair(model_dir, f"redis://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.2)
        prompts = [random_tokens(n, seed=n) for n in (1, B + 1, 3 * B)]
        outputs = pair.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for out, ref in zip(outputs, reference(model_dir, prompts)):
        assert_same(out, ref)
        assert out.num_cached_tokens == 0
    _assert_baseline(pair.prefill, pair.decode)
