"""Disaggregated prefill/decode: a prefill engine saves each prompt's KV, a decode engine loads it
and generates. Outputs equal one engine's; the decode side computes only what it did not receive;
aborts leave both pools and the store empty."""

from __future__ import annotations

import pytest
import torch

from kvflow import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from kvflow.engine.disaggregated import DisaggregatedPrefillDecode
from tiny_models import make_tiny_model

B = 8
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2,
                        output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


def _engine(model_dir, role=None, store=None, **kw) -> LLMEngine:
    args = dict(model=model_dir, dtype="float32", skip_tokenizer_init=True, block_size=B, disable_log_stats=True,
                attention_backend="torch_reference", num_kv_blocks=256)
    if role is not None:
        args["kv_transfer_config"] = {"kv_role": role, "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    return LLMEngine(EngineArgs(**{**args, **kw}))


def _pair(model_dir, store, **kw) -> DisaggregatedPrefillDecode:
    return DisaggregatedPrefillDecode(_engine(model_dir, "kv_producer", store, **kw),
                                      _engine(model_dir, "kv_consumer", store, **kw))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(model_dir, prompts) -> list:
    engine = _engine(model_dir, enable_prefix_caching=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[str(i)] for i in range(len(prompts))]


def _assert_same(out, ref) -> None:
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
        assert got.keys() == want.keys()
        for token, lp in got.items():
            assert lp.logprob == pytest.approx(want[token].logprob, abs=1e-4)


def _store_files(store) -> list:
    return sorted(p.name for p in store.iterdir())


LENGTHS = [1, B - 1, B, B + 1, 3 * B, 100]


def test_outputs_equal_one_engine_and_decode_computes_only_the_last_prompt_token(model_dir, tmp_path):
    prompts = [_tokens(n, seed=n) for n in LENGTHS]
    pair = _pair(model_dir, tmp_path)
    outputs = pair.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    block_bytes = pair.decode.runner.kv_connector.block_bytes
    for prompt, out, ref in zip(prompts, outputs, _reference(model_dir, prompts)):
        _assert_same(out, ref)
        # Every prompt token but the last came from the prefill engine, none from recomputation.
        assert out.num_cached_tokens == len(prompt) - 1
        assert out.metrics.kv_transfer_bytes == -(-(len(prompt) - 1) // B) * block_bytes
    assert _store_files(tmp_path) == []  # each request deleted its blocks when it ended
    stats = pair.decode.get_stats()
    assert stats.kv_transfer_bytes_total == sum(-(-(n - 1) // B) for n in LENGTHS) * block_bytes
    assert stats.prefix_cache_hits_total == 0
    assert pair.prefill.get_stats().kv_transfer_bytes_total == stats.kv_transfer_bytes_total


def test_chunked_prefill_on_both_sides(model_dir, tmp_path):
    prompts = [_tokens(100, seed=5), _tokens(3 * B + 2, seed=6)]
    pair = _pair(model_dir, tmp_path, max_num_batched_tokens=16)  # the prefill engine saves after its last chunk
    for prompt, out, ref in zip(prompts, pair.generate([{"prompt_token_ids": p} for p in prompts], GREEDY),
                                _reference(model_dir, prompts)):
        _assert_same(out, ref)
        assert out.num_cached_tokens == len(prompt) - 1
    assert _store_files(tmp_path) == []


def test_decode_side_prefix_hits_load_only_the_rest(model_dir, tmp_path):
    shared = _tokens(3 * B, seed=7)
    first, prompts = shared + _tokens(5, 1), [shared + _tokens(n, seed=n) for n in (1, B - 1, B + 3, 2 * B)]
    pair = _pair(model_dir, tmp_path)
    pair.generate([{"prompt_token_ids": first}], GREEDY)  # the decode engine now caches `shared`
    outputs = pair.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    block_bytes = pair.decode.runner.kv_connector.block_bytes
    for prompt, out, ref in zip(prompts, outputs, _reference(model_dir, prompts)):
        _assert_same(out, ref)
        assert out.num_cached_tokens == len(prompt) - 1
        # The 3 shared blocks were found locally: only the blocks after them moved.
        assert out.metrics.kv_transfer_bytes == (-(-(len(prompt) - 1) // B) - 3) * block_bytes
    assert _store_files(tmp_path) == []


def test_a_whole_local_hit_loads_nothing(model_dir, tmp_path):
    prompt = _tokens(2 * B + 3, seed=3)
    pair = _pair(model_dir, tmp_path)
    pair.generate([{"prompt_token_ids": prompt}], GREEDY)
    again = pair.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    _assert_same(again, _reference(model_dir, [prompt])[0])
    assert again.metrics.kv_transfer_bytes == 0 and again.num_cached_tokens == len(prompt) - 1
    assert _store_files(tmp_path) == []


def test_aborts_mid_transfer_leave_both_pools_and_the_store_empty(model_dir, tmp_path):
    pair = _pair(model_dir, tmp_path, max_num_batched_tokens=64)
    prompts = {str(i): {"prompt_token_ids": _tokens(1 + i % 37, seed=i)} for i in range(100)}
    for rid, prompt in prompts.items():
        pair.add_prefill(rid, prompt)
    prefilled = [o.request_id for _ in range(3) for o in pair.step_prefill()]
    assert 0 < len(prefilled) < 100  # some still on the prefill engine, some in the store
    for rid in prefilled[: len(prefilled) // 2]:
        pair.add_decode(rid, prompts[rid], GREEDY)
    pair.step_decode()  # some loaded and running, some waiting, the rest never sent
    assert _store_files(tmp_path)
    for rid in prompts:
        pair.abort(rid)
    for engine in (pair.prefill, pair.decode):
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.kv_cache.pool.num_free_blocks == engine.num_kv_blocks
    assert _store_files(tmp_path) == []
    # Both engines still serve, and correctly.
    prompt = _tokens(2 * B + 1, seed=99)
    _assert_same(pair.generate([{"prompt_token_ids": prompt}], GREEDY)[0], _reference(model_dir, [prompt])[0])


def test_bad_kv_transfer_config_names_the_field(model_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_role"):
        _engine(model_dir, "kv_sender", tmp_path)
    with pytest.raises(ValueError, match="unknown key 'role'"):
        _engine(model_dir, kv_transfer_config={"role": "kv_producer"})
    with pytest.raises(ValueError, match="kv_connector"):
        _engine(model_dir, kv_transfer_config='{"kv_connector": "Nixl"}')
    with pytest.raises(ValueError, match="kv_producer"):
        DisaggregatedPrefillDecode(_engine(model_dir, "kv_consumer", tmp_path), _engine(model_dir, "kv_consumer", tmp_path))


def test_sliding_window_models_are_refused(tmp_path):
    make_tiny_model("mistral-window", tmp_path / "m")
    with pytest.raises(ValueError, match="sliding-window"):
        _engine(str(tmp_path / "m"), "kv_both", tmp_path / "store")
