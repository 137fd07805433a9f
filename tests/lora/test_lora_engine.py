"""The adapter cache and the scheduler around it: adapters never share cached blocks, a step
never mixes more adapters than there are slots, evicted adapters come back identical, and a bad
adapter is refused by name while the requests in flight run on untouched."""

from __future__ import annotations

import json

import pytest
import torch
from peft_adapters import make_adapter
from tiny_models import make_tiny_model

from kvflow import LLM, EngineArgs, LLMEngine, LoRARequest, SamplingParams

ARCH = "llama-gqa-llama3-rope"
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base")
    return make_tiny_model(ARCH, directory), str(directory)


@pytest.fixture(scope="module")
def loras(base, tmp_path_factory) -> list[LoRARequest]:
    hf, _ = base
    made = []
    for i, r in enumerate((2, 4, 8), start=1):
        directory = tmp_path_factory.mktemp(f"adapter{i}")
        make_adapter(hf, directory, seed=i, r=r, lora_alpha=2 * r)
        made.append(LoRARequest(f"adapter{i}", i, str(directory)))
    return made


def _llm(base_dir: str, **args) -> LLM:
    return LLM(base_dir, skip_tokenizer_init=True, enable_lora=True, disable_log_stats=True,
               **{"dtype": "float32", "max_loras": 3, "max_lora_rank": 8, **args})


def _prompt(n: int = 40, seed: int = 0) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tokens_and_logprobs(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


def test_two_adapters_share_no_cached_block(base, loras):
    llm = _llm(base[1], block_size=8)
    prompt = _prompt()
    first = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=loras[0])[0]
    assert first.num_cached_tokens == 0
    for other in (loras[1], None):  # another adapter, and the base, find nothing of the first's
        out = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=other)[0]
        assert out.num_cached_tokens == 0
        fresh = _llm(base[1], block_size=8).generate([prompt], PARAMS, use_tqdm=False, lora_request=other)[0]
        assert out.outputs[0].token_ids == fresh.outputs[0].token_ids
    again = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=loras[0])[0]
    assert again.num_cached_tokens > 0  # while the same adapter finds its own blocks
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_eviction_and_reload_give_identical_outputs(base, loras):
    prompts = [_prompt(n, seed) for seed, n in enumerate((40, 7, 23, 15, 31))]
    choice = [loras[0], loras[1], loras[2], None, loras[0]]
    roomy = _llm(base[1], enable_prefix_caching=False)
    expected = roomy.generate(prompts, PARAMS, use_tqdm=False, lora_request=choice)
    # One slot and one host entry: every change of adapter evicts, and every return reloads from disk.
    tight = _llm(base[1], enable_prefix_caching=False, max_loras=1, max_cpu_loras=1)
    mixes = []
    execute = tight.llm_engine.runner.execute
    tight.llm_engine.runner.execute = (
        lambda sched: mixes.append({c.lora_request for c in sched.chunks} - {None}) or execute(sched))
    for _ in range(2):
        got = tight.generate(prompts, PARAMS, use_tqdm=False, lora_request=choice)
        for want, out in zip(expected, got):
            want_tokens, want_lps = _tokens_and_logprobs(want)
            tokens, lps = _tokens_and_logprobs(out)
            assert tokens == want_tokens
            torch.testing.assert_close(lps, want_lps, atol=1e-4, rtol=0)
    assert max(len(m) for m in mixes) == 1  # the scheduler never mixed two adapters into one step
    stats = tight.llm_engine.runner.lora.stats
    assert stats.disk_loads > 3 and stats.slot_loads > 3  # adapters really were evicted and reloaded
    assert stats.disk_load_seconds > 0 and stats.slot_load_seconds > 0


def _bad_adapters(base, tmp_path) -> dict[str, tuple[LoRARequest, str]]:
    """name → (request, what its error must say)."""
    hf, _ = base
    cases = {}

    def adapter(name, model=hf, **config):
        directory = tmp_path / name
        make_adapter(model, directory, seed=0, **config)
        return LoRARequest(name, 100 + len(cases), str(directory))

    cases["too-big"] = adapter("too-big", r=16), "has rank 16 (module 'model.layers.0.mlp.down_proj'), above max_lora_rank 8"
    cases["head"] = adapter("head", target_modules=["q_proj", "lm_head"]), "cannot adapt: lm_head"
    other = make_tiny_model("qwen3-qknorm", tmp_path / "other-base")
    cases["other-base"] = adapter("other-base", model=other), "k_proj.lora_B has shape (64, 4), expected (32, 4)"
    cases["missing"] = LoRARequest("missing", 120, str(tmp_path / "nowhere")), "does not exist"
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    cases["no-weights"] = LoRARequest("no-weights", 121, str(tmp_path / "no-weights")), "no adapter_model.safetensors"
    dora = adapter("dora", use_dora=True)
    cases["dora"] = dora, "use_dora=True"
    cases["reused-id"] = LoRARequest("reused-id", 1, str(tmp_path / "too-big")), "lora_int_id 1 already names"
    return cases


def test_bad_adapters_are_refused_by_name_and_harm_nothing(base, loras, tmp_path):
    engine = LLMEngine(EngineArgs(base[1], dtype="float32", skip_tokenizer_init=True, enable_lora=True,
                                  max_loras=2, max_lora_rank=8, disable_log_stats=True))
    victim_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = LLM(base[1], dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8).generate(
        [_prompt(20)], victim_params, use_tqdm=False, lora_request=loras[0])[0].outputs[0].token_ids
    engine.add_request("victim", _prompt(20), victim_params, lora_request=loras[0])
    engine.step()
    for name, (request, message) in _bad_adapters(base, tmp_path).items():
        with pytest.raises(ValueError, match=f"LoRA adapter '{name}'") as refused:
            engine.add_request(f"bad-{name}", _prompt(5), PARAMS, lora_request=request)
        assert message in str(refused.value)
        assert f"bad-{name}" not in engine.scheduler.requests
        engine.step()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].request_id == "victim" and outputs[-1].outputs[0].token_ids == alone
    assert engine.kv_cache_usage == 0


def test_lora_needs_enable_lora(base, loras):
    llm = LLM(base[1], dtype="float32", skip_tokenizer_init=True, disable_log_stats=True)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate([_prompt(5)], PARAMS, use_tqdm=False, lora_request=loras[0])
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="one .or None. per prompt"):
        _llm(base[1]).generate([_prompt(5)] * 2, PARAMS, use_tqdm=False, lora_request=[loras[0]])


def test_adapters_of_unfinished_requests_stay_in_host_memory(base, loras, tmp_path):
    """One slot and one host entry, and the files of an adapter a queued request needs are gone
    before it runs: it still runs from host memory, and nobody's step fails."""
    import shutil

    doomed = LoRARequest("doomed", 50, str(tmp_path / "doomed"))
    shutil.copytree(loras[0].lora_path, doomed.lora_path)
    plan = [("a", doomed, 0), ("b", loras[1], 1), ("c", doomed, 2), ("d", loras[2], 3)]
    alone = {name: _llm(base[1]).generate([_prompt(9, seed)], PARAMS, use_tqdm=False, lora_request=lora)[0]
             for name, lora, seed in plan}
    engine = LLMEngine(EngineArgs(base[1], dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_loras=1,
                                  max_cpu_loras=1, max_lora_rank=8, disable_log_stats=True))
    finished = {}

    def run_until(condition):
        while not condition():
            finished.update({o.request_id: o for o in engine.step() if o.finished})

    for name, lora, seed in plan[:2]:
        engine.add_request(name, _prompt(9, seed), PARAMS, lora_request=lora)
    run_until(lambda: "a" in finished)  # b's adapter now holds the only slot
    engine.add_request("c", _prompt(9, 2), PARAMS, lora_request=doomed)
    shutil.rmtree(doomed.lora_path)
    engine.add_request("d", _prompt(9, 3), PARAMS, lora_request=loras[2])  # over the host bound
    run_until(lambda: not engine.has_unfinished_requests())
    for name in alone:
        assert finished[name].outputs[0].token_ids == alone[name].outputs[0].token_ids
    assert engine.runner.lora.list_loras() == [loras[2].lora_int_id]  # the bound holds again once they finished


def test_batch_invariant_adapters_are_bit_identical_alone_batched_and_chunked(base, loras):
    """With batch_invariant, an adapter's deltas run on fixed row tiles, like the base layers: a
    bfloat16 request's tokens and logprobs do not depend on its batch or its prompt's chunks
    (without the tiles the masked and per-segment forms, and every segment length, round apart)."""
    _, base_dir = base
    target = _prompt(70, seed=1)
    kw = dict(dtype="bfloat16", batch_invariant=True, num_kv_blocks=128, max_loras=3)
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    alone = _llm(base_dir, **kw).generate([target], params, lora_request=loras[1], use_tqdm=False)[0]
    busy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [_prompt(n, seed=n) for n in (3, 50, 17)]
    mixed = _llm(base_dir, max_num_batched_tokens=24, **kw).generate(
        [prompts[0], target, *prompts[1:]], [busy, params, busy, busy],
        lora_request=[loras[0], loras[1], None, loras[2]], use_tqdm=False)[1]

    def exact(out):
        c = out.outputs[0]
        return c.token_ids, [sorted((k, lp.logprob) for k, lp in step.items()) for step in c.logprobs]

    assert exact(mixed) == exact(alone)
