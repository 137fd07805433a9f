"""Pipeline parallel: the layers split into stages, a rank each, batches in flight through them
(float32, CPU, gloo). Each stage runs its layers' operations on the same numbers as one rank does,
so greedy tokens, seeded samples and logprobs equal the single-rank engine's, which the
single-rank tests hold to HF transformers; and the engine keeps a batch per stage in flight.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, EngineArgs, SamplingParams
from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request, RequestStatus
from kvflow.core.scheduler import Scheduler
from kvflow.distributed.pipeline import check_stages, stage_layers
from kvflow.kv_cache_spec import FullAttentionSpec, SharedKVSpec

PP_TIMEOUT = pytest.mark.timeout(600, method="thread")  # a lost rank must fail the test, not hang it


def _prompts(lengths, seed=1) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 97, (n,), generator=gen).tolist()} for n in lengths]


def _llm(path: str, pp: int, **kw) -> LLM:
    return LLM(path, dtype="float32", skip_tokenizer_init=True, pipeline_parallel_size=pp, distributed_timeout_s=60,
               num_kv_blocks=96, block_size=8, disable_log_stats=True, **kw)


def _run(path: str, pp: int, prompts, params, **kw):
    llm = _llm(path, pp, **kw)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def _generated(outs) -> list[tuple[list[int], list[float]]]:
    result = []
    for out in outs:
        c = out.outputs[0]
        result.append((c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
    return result


def test_stages_take_contiguous_layers_as_even_as_the_count_allows():
    assert [list(stage_layers(7, s, 3)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(stage_layers(4, s, 2)) for s in range(2)] == [[0, 1], [2, 3]]


def test_a_layer_reading_another_stages_kv_is_refused():
    full = FullAttentionSpec(num_kv_heads=2, head_dim=8)
    specs = [full, full, SharedKVSpec(target_layer=1), SharedKVSpec(target_layer=1)]
    check_stages(specs, 1, "m")
    with pytest.raises(ValueError, match="layer 2 on stage 1 and layer 1"):
        check_stages(specs, 2, "m")
    with pytest.raises(ValueError, match="more stages than"):
        check_stages(specs, 5, "m")


@pytest.mark.parametrize("field, value", [
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    ("enable_lora", True),
    ("data_parallel_size", 2),
])
def test_what_does_not_compose_yet_is_refused_with_its_reason(field, value):
    args = EngineArgs(model="unused", pipeline_parallel_size=2, **{field: value})
    with pytest.raises(ValueError, match=f"pipeline_parallel_size=2 with {field}: "):
        args.create_config(512)


def test_a_request_in_flight_is_not_scheduled_again_and_an_abort_waits_for_its_batch():
    kv = KVCacheManager(32, 4)
    s = Scheduler(SchedulerConfig(64, 8, "fcfs"), kv, 256)
    for rid, first in (("a", 0), ("b", 100)):
        s.add_request(Request(rid, list(range(first, first + 6)), SamplingParams(max_tokens=4), 4, frozenset({0})))
    first = s.schedule()
    assert {c.request_id for c in first.chunks} == {"a", "b"}
    assert s.schedule().chunks == []  # both in flight: nothing to run beside them
    both = kv.usage
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert kv.usage == both  # a's blocks wait: a later stage may still write its KV
    s.update_from_output(first, {"b": [7]})
    assert 0 < kv.usage < both  # landed: a's blocks are back, b keeps its own
    assert [c.request_id for c in s.schedule().chunks] == ["b"]


# (tiny model, stages, tensor-parallel ranks per stage): untied and tied heads (the tied one on
# the last stage is the first stage's embedding), a 5:1 local/global hybrid over three stages,
# experts, latent attention; two stages of two tensor-parallel ranks each.
CASES = [("llama-gqa-llama3-rope", 2, 1), ("llama-mha-tied", 2, 1), ("gemma3", 3, 1), ("mixtral", 2, 1),
         ("deepseek-v2", 3, 1), ("llama-gqa-llama3-rope", 2, 2)]


@PP_TIMEOUT
@pytest.mark.parametrize("arch, stages, tp", CASES, ids=[f"{c[0]}-pp{c[1]}-tp{c[2]}" for c in CASES])
def test_stages_give_the_tokens_and_logprobs_of_one_rank(arch, stages, tp, tmp_path):
    make_tiny_model(arch, tmp_path)
    prompts = _prompts([5, 37, 12, 20])
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=1),
              SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True, logprobs=0)]
    kw = {"max_num_batched_tokens": 16}  # prompts span several steps: chunks and decodes share batches
    single = _run(str(tmp_path), 1, prompts, params, **kw)
    split = _run(str(tmp_path), stages, prompts, params, tensor_parallel_size=tp, **kw)
    for one, two in zip(_generated(single), _generated(split)):
        assert two[0] == one[0]
        torch.testing.assert_close(torch.tensor(two[1]), torch.tensor(one[1]), atol=1e-5, rtol=0)
    prompt_lps = [[next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]] for out in (single[2], split[2])]
    torch.testing.assert_close(torch.tensor(prompt_lps[1]), torch.tensor(prompt_lps[0]), atol=1e-5, rtol=0)


@PP_TIMEOUT
def test_batches_are_in_flight_on_every_stage_and_an_abort_leaks_no_block(tmp_path):
    make_tiny_model("llama-gqa-llama3-rope", tmp_path)
    llm = _llm(str(tmp_path), 2, max_num_batched_tokens=16)
    engine = llm.llm_engine
    in_flight_at_submit = []
    submit = engine.model_executor.submit

    def counting_submit(sched):
        in_flight_at_submit.append(len(engine._in_flight))
        return submit(sched)

    engine.model_executor.submit = counting_submit
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(_prompts([9, 30, 4, 17, 22, 6])):
            engine.add_request(str(i), prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if steps == 4:
                engine.abort_request(["1", "4"])
        pool = engine.scheduler.kv_cache.pool
        assert max(in_flight_at_submit) == 1  # a second batch went while the first was on the other stage
        assert pool.num_free_blocks == pool.num_blocks  # the aborted requests' blocks came back after their batches
    finally:
        engine.shutdown()
