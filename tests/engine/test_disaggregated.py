"""Disaggregated prefill/decode: a prefill engine saves each prompt's KV, a decode engine loads it
and generates, through each store (`disagg_stores`). Outputs equal one engine's; the decode side
computes only what it did not receive; aborts leave both pools and the store empty."""

from __future__ import annotations

import pytest
from disagg_stores import GREEDY, B, assert_same, make_engine, make_pair, make_store, model_dir, random_tokens, reference, store  # noqa: F401  (fixtures)
from tiny_models import make_tiny_model

from kvflow.engine.disaggregated import DisaggregatedPrefillDecode

LENGTHS = [1, B - 1, B, B + 1, 3 * B, 100]


def test_outputs_equal_one_engine_and_decode_computes_only_the_last_prompt_token(model_dir, store):
    prompts = [random_tokens(n, seed=n) for n in LENGTHS]
    pair = make_pair(model_dir, store)
    outputs = pair.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    block_bytes = pair.decode.runner.kv_connector.block_bytes
    for prompt, out, ref in zip(prompts, outputs, reference(model_dir, prompts)):
        assert_same(out, ref)
        # Every prompt token but the last came from the prefill engine, none from recomputation.
        assert out.num_cached_tokens == len(prompt) - 1
        assert out.metrics.kv_transfer_bytes == -(-(len(prompt) - 1) // B) * block_bytes
    assert store.contents() == []  # each request deleted its blocks when it ended
    stats = pair.decode.get_stats()
    assert stats.kv_transfer_bytes_total == sum(-(-(n - 1) // B) for n in LENGTHS) * block_bytes
    assert stats.prefix_cache_hits_total == 0
    assert pair.prefill.get_stats().kv_transfer_bytes_total == stats.kv_transfer_bytes_total


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "int8"])
def test_quantized_kv_moves_through_the_store(model_dir, store, kv):
    """A one-byte KV cache (kv_quant.py): its blocks, codes and scales, move as bytes and are read
    back as the codes they were; outputs equal one engine's with the same kv_cache_dtype."""
    prompts = [random_tokens(n, seed=n) for n in (B + 1, 3 * B)]
    pair = make_pair(model_dir, store, kv_cache_dtype=kv)
    outputs = pair.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out, ref in zip(prompts, outputs, reference(model_dir, prompts, kv_cache_dtype=kv)):
        assert_same(out, ref)
        assert out.num_cached_tokens == len(prompt) - 1  # loaded, not recomputed
    assert store.contents() == []


@pytest.mark.parametrize(("producer", "consumer", "namespace"), [
    (dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="int8"), None),  # blocks of one size, other codes
    (dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="fp8_e5m2"), None),
    (dict(), dict(), "another fine-tune"),  # nothing in the configs differs but the user's namespace
])
def test_engines_whose_kv_differs_never_read_each_others_blocks(model_dir, store, producer, consumer, namespace):
    """Equal block hashes, different bytes: the consumer finds nothing of the producer's, computes
    its prompt, and answers as one engine of its own kind."""
    prompts = [random_tokens(n, seed=n) for n in (B + 1, 3 * B)]
    config = store.config("kv_consumer")
    if namespace is not None:
        config["kv_connector_extra_config"] = {**config.get("kv_connector_extra_config", {}),
                                               "kv_store_namespace": namespace}
    pair = DisaggregatedPrefillDecode(make_engine(model_dir, "kv_producer", store, **producer),
                                      make_engine(model_dir, kv_transfer_config=config, **consumer))
    outputs = pair.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for out, ref in zip(outputs, reference(model_dir, prompts, **consumer)):
        assert_same(out, ref)
        assert out.num_cached_tokens == 0  # nothing loaded: computed
    assert pair.decode.get_stats().kv_transfer_bytes_total == 0


def test_chunked_prefill_on_both_sides(model_dir, store):
    prompts = [random_tokens(100, seed=5), random_tokens(3 * B + 2, seed=6)]
    pair = make_pair(model_dir, store, max_num_batched_tokens=16)  # the prefill engine saves after its last chunk
    for prompt, out, ref in zip(prompts, pair.generate([{"prompt_token_ids": p} for p in prompts], GREEDY),
                                reference(model_dir, prompts)):
        assert_same(out, ref)
        assert out.num_cached_tokens == len(prompt) - 1
    assert store.contents() == []


def test_decode_side_prefix_hits_load_only_the_rest(model_dir, store):
    shared = random_tokens(3 * B, seed=7)
    first, prompts = shared + random_tokens(5, 1), [shared + random_tokens(n, seed=n) for n in (1, B - 1, B + 3, 2 * B)]
    pair = make_pair(model_dir, store)
    pair.generate([{"prompt_token_ids": first}], GREEDY)  # the decode engine now caches `shared`
    outputs = pair.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    block_bytes = pair.decode.runner.kv_connector.block_bytes
    for prompt, out, ref in zip(prompts, outputs, reference(model_dir, prompts)):
        assert_same(out, ref)
        assert out.num_cached_tokens == len(prompt) - 1
        # The 3 shared blocks were found locally: only the blocks after them moved.
        assert out.metrics.kv_transfer_bytes == (-(-(len(prompt) - 1) // B) - 3) * block_bytes
    assert store.contents() == []


def test_a_whole_local_hit_loads_nothing(model_dir, store):
    prompt = random_tokens(2 * B + 3, seed=3)
    pair = make_pair(model_dir, store)
    pair.generate([{"prompt_token_ids": prompt}], GREEDY)
    again = pair.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    assert_same(again, reference(model_dir, [prompt])[0])
    assert again.metrics.kv_transfer_bytes == 0 and again.num_cached_tokens == len(prompt) - 1
    assert store.contents() == []


def test_aborts_mid_transfer_leave_both_pools_and_the_store_empty(model_dir, store):
    pair = make_pair(model_dir, store, max_num_batched_tokens=64)
    prompts = {str(i): {"prompt_token_ids": random_tokens(1 + i % 37, seed=i)} for i in range(100)}
    for rid, prompt in prompts.items():
        pair.add_prefill(rid, prompt)
    prefilled = [o.request_id for _ in range(3) for o in pair.step_prefill()]
    assert 0 < len(prefilled) < 100  # some still on the prefill engine, some in the store
    for rid in prefilled[: len(prefilled) // 2]:
        pair.add_decode(rid, prompts[rid], GREEDY)
    pair.step_decode()  # some loaded and running, some waiting, the rest never sent
    assert store.contents()
    for rid in prompts:
        pair.abort(rid)
    for engine in (pair.prefill, pair.decode):
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.kv_cache.pool.num_free_blocks == engine.num_kv_blocks
    assert store.contents() == []
    # Both engines still serve, and correctly.
    prompt = random_tokens(2 * B + 1, seed=99)
    assert_same(pair.generate([{"prompt_token_ids": prompt}], GREEDY)[0], reference(model_dir, [prompt])[0])


def test_bad_kv_transfer_config_names_the_field(model_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_role"):
        make_engine(model_dir, "kv_sender", tmp_path)
    with pytest.raises(ValueError, match="unknown key 'role'"):
        make_engine(model_dir, kv_transfer_config={"role": "kv_producer"})
    with pytest.raises(ValueError, match="kv_connector"):
        make_engine(model_dir, kv_transfer_config='{"kv_connector": "Nixl"}')
    with pytest.raises(ValueError, match="kv_producer"):
        DisaggregatedPrefillDecode(make_engine(model_dir, "kv_consumer", tmp_path),
                                   make_engine(model_dir, "kv_consumer", tmp_path))
    with pytest.raises(ValueError, match="kv_store_url is required"):
        make_engine(model_dir, kv_transfer_config={"kv_connector": "RedisStoreConnector"})
    with pytest.raises(ValueError, match="'TCPStoreConnector' was replaced by RedisStoreConnector"):
        make_engine(model_dir, kv_transfer_config={"kv_connector": "TCPStoreConnector"})
    with pytest.raises(ValueError, match="must share one KV store"):
        DisaggregatedPrefillDecode(make_engine(model_dir, "kv_producer", tmp_path / "a"),
                                   make_engine(model_dir, "kv_consumer", tmp_path / "b"))


def test_sliding_window_models_are_refused(tmp_path):
    make_tiny_model("mistral-window", tmp_path / "m")
    with pytest.raises(ValueError, match="sliding-window"):
        make_engine(str(tmp_path / "m"), "kv_both", tmp_path / "store")


@pytest.mark.parametrize(("rope_scaling", "apart"), [
    (None, False),
    ({"rope_type": "dynamic", "factor": 2.0}, True),  # its base is grown for max_model_len
])
def test_a_length_dependent_rope_keeps_engines_of_other_lengths_apart(rope_scaling, apart):
    """Keys rotated for another max_model_len are other bytes under equal hashes (longrope, dynamic)."""
    from kvflow import EngineArgs
    from kvflow.engine.llm_engine import with_kv_store_namespace
    from kvflow.model.arch_config import ArchConfig

    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 512, "rope_scaling": rope_scaling}
    arch = ArchConfig.from_hf(hf)
    namespaces = {with_kv_store_namespace(EngineArgs(max_model_len=n, kv_transfer_config={}).create_config(
        arch.max_position_embeddings), arch).kv_transfer.namespace for n in (256, 512)}
    assert len(namespaces) == (2 if apart else 1)
