"""Features compose with tensor parallel (float32, CPU, gloo; TP=2 against TP=1 with the same
features, which the single-rank tests hold to HF transformers and PEFT):

- speculative decoding, every method: every rank verifies the proposals the step message carries
  and proposes the next ones (layer skip runs the target's first layers on every rank, a draft
  model is whole on every rank), so greedy outputs equal TP=1's token for token;
- LoRA, adapters sharded like the layers they wrap (column-parallel: A whole, B by output rows;
  row-parallel: A by input columns, B whole, the partial deltas summed by the layer's all-reduce):
  logprobs within 1e-4 of TP=1 with the same adapters, base rows beside them untouched;
- the mixed case: n-gram speculation + a LoRA adapter + prefix caching + an int8 KV cache on one
  batch, TP=2 equal to TP=1 with the same features.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft_adapters import make_adapter
from tiny_models import make_tiny_model

from kvflow import LLM, LoRARequest, SamplingParams

ARCH = "llama-gqa-llama3-rope"  # 4 heads, 2 KV heads: one KV head per rank
TP_TIMEOUT = pytest.mark.timeout(600, method="thread")  # a lost rank must fail the test, not hang it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("target")
    hf = make_tiny_model(ARCH, directory)
    return hf, str(directory)


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory) -> list[LoRARequest]:
    hf, _ = model
    made = []
    for i, r in enumerate((4, 8), start=1):
        directory = tmp_path_factory.mktemp(f"adapter{i}")
        make_adapter(hf, directory, seed=i, r=r, lora_alpha=2 * r)
        made.append(LoRARequest(f"adapter{i}", i, str(directory)))
    return made


def _prompts(lengths, seed=1) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 97, (n,), generator=gen).tolist()} for n in lengths]


def _repetitive(n: int) -> dict:
    """A prompt the n-gram proposer finds matches in (and the tiny model tends to continue)."""
    return {"prompt_token_ids": [11, 12, 13, 14, 15, 16] * (n // 6)}


def _llm(path: str, tp: int, **kw) -> LLM:
    return LLM(path, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=tp, distributed_timeout_s=60,
               num_kv_blocks=96, block_size=8, disable_log_stats=True, **kw)


def _run(path: str, tp: int, prompts, params, engine_args: dict, lora_request=None):
    llm = _llm(path, tp, **engine_args)
    try:
        outs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
        return outs, stats
    finally:
        llm.llm_engine.shutdown()


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@TP_TIMEOUT
@pytest.mark.parametrize("speculative_config", [
    {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    {"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 2, "adaptive": False},
    "draft_model",
], ids=["ngram", "layer_skip", "draft_model"])
def test_speculation_under_tensor_parallel_gives_the_tokens_of_one_rank(model, speculative_config, tmp_path):
    _, path = model
    if speculative_config == "draft_model":
        make_tiny_model("llama-mqa", tmp_path)  # a smaller model with the same vocabulary
        speculative_config = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2,
                              "adaptive": False}
    prompts = [_repetitive(30), *_prompts([5, 17])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    args = {"speculative_config": speculative_config}
    single, _ = _run(path, 1, prompts, params, args)
    split, stats = _run(path, 2, prompts, params, args)
    assert _tokens(split) == _tokens(single)
    assert stats.spec_decoding is not None and stats.spec_decoding.num_draft_tokens > 0  # it did speculate


def _logprobs(out) -> list[float]:
    c = out.outputs[0]
    return [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


@TP_TIMEOUT
def test_token_eviction_under_tensor_parallel_gives_the_tokens_of_one_rank(model):
    """A KV budget's compacted tables and evicted counts travel in the step message: every rank
    drops the same blocks and rotates by the same positions."""
    prompts = _prompts((70, 9))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    args = dict(kv_eviction_policy="sink_window", kv_budget_tokens=48, max_num_batched_tokens=24)
    (one, _), (two, _) = (_run(model[1], tp, prompts, params, args) for tp in (1, 2))
    for a, b in zip(one, two):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: p.logprob for t, p in y.items()} == pytest.approx({t: p.logprob for t, p in x.items()}, abs=1e-4)


@TP_TIMEOUT
def test_beam_search_under_tensor_parallel_finds_the_beams_of_one_rank(model):
    """The beams' requests (one token each, top logprobs, sharing blocks copy-on-write) are plain
    requests to the engine: TP=2 ranks and scores them as TP=1 does."""
    from kvflow import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    prompts = [p["prompt_token_ids"] for p in _prompts((5, 19))]
    found = []
    for tp in (1, 2):
        llm = _llm(model[1], tp)
        try:
            found.append(llm.beam_search(prompts, params))
        finally:
            llm.llm_engine.shutdown()
    for one, two in zip(*found):
        assert [s.tokens for s in two.sequences] == [s.tokens for s in one.sequences]
        assert [s.score for s in two.sequences] == pytest.approx([s.score for s in one.sequences], abs=1e-4)


@TP_TIMEOUT
def test_lora_adapters_are_sharded_like_their_layers(model, adapters):
    _, path = model
    prompts = _prompts([9, 23, 4, 14])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    requests = [adapters[0], None, adapters[1], adapters[0]]
    args = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    single, _ = _run(path, 1, prompts, params, args, requests)
    split, _ = _run(path, 2, prompts, params, args, requests)
    assert _tokens(split) == _tokens(single)
    for one, two in zip(single, split):
        torch.testing.assert_close(torch.tensor(_logprobs(two)), torch.tensor(_logprobs(one)), atol=1e-4, rtol=0)


@TP_TIMEOUT
def test_speculation_lora_prefix_caching_and_int8_kv_on_one_batch(model, adapters):
    _, path = model
    shared = _repetitive(24)["prompt_token_ids"]
    prompts = [{"prompt_token_ids": shared + [7, 8, 9]}, {"prompt_token_ids": shared + [40]}, *_prompts([13])]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    args = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "enable_prefix_caching": True,
            "kv_cache_dtype": "int8", "speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_min": 1, "adaptive": False}}
    requests = [adapters[0], adapters[0], None]
    single, _ = _run(path, 1, prompts, params, args, requests)
    split, stats = _run(path, 2, prompts, params, args, requests)
    assert _tokens(split) == _tokens(single)
    assert stats.prefix_cache_hits_total > 0 and stats.spec_decoding.num_draft_tokens > 0


@TP_TIMEOUT
def test_data_parallel_replicas_of_two_ranks_each_serve_like_one_engine(model):
    """Each replica is a tensor-parallel group (its ranks are the replica's children): the
    replicas' answers equal one single-rank engine's."""
    import asyncio

    from kvflow import EngineArgs, RequestOutputKind
    from kvflow.engine.dp_async_llm import DPAsyncLLM

    _, path = model
    prompts = _prompts([3, 11, 6, 19, 8, 2])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = _tokens(_run(path, 1, prompts, params, {})[0])
    dp = DPAsyncLLM(EngineArgs(path, dtype="float32", skip_tokenizer_init=True, data_parallel_size=2,
                               tensor_parallel_size=2, distributed_timeout_s=60, num_kv_blocks=96, block_size=8,
                               disable_log_stats=True))

    async def one(prompt, i) -> list[int]:
        tokens = []
        delta = params.clone(output_kind=RequestOutputKind.DELTA)
        async for out in dp.generate(prompt, delta, f"r{i}"):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        return await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))

    try:
        assert asyncio.run(asyncio.wait_for(main(), 300)) == expected
        served = [r.stats.prompt_tokens_total for r in dp.replicas]
        assert all(n > 0 for n in served), served  # both replicas served
    finally:
        dp.shutdown(timeout=30)


def test_each_rank_takes_its_own_gpu(monkeypatch):
    """Ranks on one machine took the device the engine was given, all of them the same GPU; each
    now takes the one its machine rank names, counted from the engine's (a replica's first GPU)."""
    from kvflow.distributed.process_groups import DistributedInit, rank_device

    assert [rank_device("cuda", r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert rank_device("cuda:2", 1) == "cuda:3" and rank_device("cpu", 5) == "cpu"
    assert DistributedInit.parse("tcp://h:1", 4, 3).machine_rank == 0  # by hand: one rank per machine
    for key, value in {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    assert DistributedInit.from_torchrun().machine_rank == 1


@TP_TIMEOUT
def test_disaggregated_prefill_and_decode_of_two_ranks_each(model, tmp_path):
    """Every rank stores and loads its own KV heads' part of each block under its own key; the pair
    of two-rank engines answers as one single-rank engine, and the store is left empty."""
    from disagg_stores import GREEDY, assert_same, make_engine, random_tokens, reference

    from kvflow.engine.disaggregated import DisaggregatedPrefillDecode

    _, path = model
    prompts = [random_tokens(n, seed=n) for n in (5, 17, 30)]
    tp = dict(tensor_parallel_size=2, distributed_timeout_s=60)
    pair = DisaggregatedPrefillDecode(make_engine(path, "kv_producer", tmp_path / "kv", **tp),
                                      make_engine(path, "kv_consumer", tmp_path / "kv", **tp))
    try:
        outputs = pair.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        for prompt, out, ref in zip(prompts, outputs, reference(path, prompts)):
            assert_same(out, ref)
            assert out.num_cached_tokens == len(prompt) - 1  # loaded, not computed
        assert not any((tmp_path / "kv").iterdir())  # every rank's parts deleted with their request
    finally:
        pair.prefill.shutdown()
        pair.decode.shutdown()


@TP_TIMEOUT
def test_a_part_missing_on_one_rank_makes_every_rank_recompute(model, tmp_path):
    """Rank 1's part of a block vanishes between the lookup and the load: the ranks agree that the
    load failed (rank 0 alone would have used its own part beside rank 1's garbage), and the
    request computes its prompt on every rank, with the tokens of one engine."""
    from disagg_stores import GREEDY, assert_same, make_engine, random_tokens, reference

    from kvflow.core.kv_connector import rank_key
    from kvflow.engine.disaggregated import DisaggregatedPrefillDecode

    _, path = model
    prompts = [random_tokens(n, seed=n) for n in (20, 9)]
    store, tp = tmp_path / "kv", dict(tensor_parallel_size=2, distributed_timeout_s=60)
    pair = DisaggregatedPrefillDecode(make_engine(path, "kv_producer", store, **tp),
                                      make_engine(path, "kv_consumer", store, **tp))
    executor = pair.decode.model_executor
    execute = executor.execute_model

    def losing_rank_1s_part(sched):
        meta = sched.kv_connector_metadata
        if meta is not None and meta.loads:
            victim = meta.loads[0].request_id
            for t in (t for t in meta.loads if t.request_id == victim):
                stored = pair.decode.scheduler.kv_connector.store.stored_key(rank_key(t.key, 1, 2))
                (store / f"{stored.hex()}.kv").unlink(missing_ok=True)
        return execute(sched)

    executor.execute_model = losing_rank_1s_part
    try:
        outputs = pair.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        for out, ref in zip(outputs, reference(path, prompts)):
            assert_same(out, ref)
        assert sorted(o.num_cached_tokens for o in outputs) == [0, len(prompts[1]) - 1]  # one recomputed
    finally:
        pair.prefill.shutdown()
        pair.decode.shutdown()


@TP_TIMEOUT
def test_lora_on_a_mixtures_shared_experts_is_reduced_once(tmp_path):
    """A shared expert's down projection returns its partial sum for the mixture to reduce once:
    its LoRA delta rides in that partial sum (reduced twice, it would count N times)."""
    from safetensors.torch import save_file

    path = tmp_path / "deepseek"
    cfg = make_tiny_model("deepseek-v2", path).config
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    gen, tensors = torch.Generator().manual_seed(3), {}
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        for module, (fan_in, fan_out) in {"gate_proj": (cfg.hidden_size, shared), "down_proj": (shared, cfg.hidden_size)}.items():
            name = f"base_model.model.model.layers.{layer}.mlp.shared_experts.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(4, fan_in, generator=gen) * 0.3
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, 4, generator=gen) * 0.3
    (tmp_path / "adapter").mkdir()
    save_file(tensors, tmp_path / "adapter" / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj", "down_proj"], "bias": "none"}
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    adapter = LoRARequest("shared", 1, str(tmp_path / "adapter"))
    prompts = _prompts([9, 15])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    args = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 4}
    single, _ = _run(str(path), 1, prompts, params, args, adapter)
    base, _ = _run(str(path), 1, prompts, params, {})
    split, _ = _run(str(path), 2, prompts, params, args, adapter)
    assert _logprobs(single[0]) != _logprobs(base[0])  # the adapter changes something
    assert _tokens(split) == _tokens(single)
    for one, two in zip(single, split):
        torch.testing.assert_close(torch.tensor(_logprobs(two)), torch.tensor(_logprobs(one)), atol=1e-4, rtol=0)
