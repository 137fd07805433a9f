"""kv_cache_dtype fp8 (E4M3), fp8_e5m2 / int8 through the engine: close to the float32 oracle, scheduling-invariant
(prefix hits, preemption by swap and by recompute), more tokens in the same memory, and clear
errors for what it cannot do."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, EngineArgs, LLMEngine, SamplingParams
from kvflow.analysis.model_spec import ModelSpec
from kvflow.entrypoints.cli import build_parser

QUANTIZED = ["fp8", "fp8_e5m2", "int8"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

# Largest |logprob - oracle logprob| allowed over the prompt tokens below, and the mean. This
# random model's attention is sharper than a trained one's (initializer range 0.3), so KV errors
# reach the logits strongly; the bounds are about twice the deviations measured on these prompts
# and keep the formats' order: E5M2 rounds to 2 mantissa bits (up to 1/8 of a value), E4M3 to 3
# (1/16), int8 to 1/254 of the vector's largest value. Misplaced or mis-scaled codes cost whole nats.
TOLERANCE = {"fp8": (1.5, 0.25), "fp8_e5m2": (2.0, 0.45), "int8": (0.25, 0.05)}


@pytest.fixture(scope="module")
def qknorm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_tiny_model("qwen3-qknorm", path)  # q/k norms bound the scores, as in current models
    return str(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-gqa")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


def _prompts(lengths=(20, 40, 60, 80), seed=3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]


def _llm(model_dir, **kw) -> LLM:
    return LLM(model_dir, dtype="float32", skip_tokenizer_init=True, **kw)


def _prompt_logprobs(llm: LLM, prompts, top: int = 0) -> list[list[dict]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top))
    return [o.prompt_logprobs[1:] for o in outs]


@pytest.fixture(scope="module")
def oracle(qknorm_dir):
    return _llm(qknorm_dir, attention_backend="torch_reference")


@pytest.mark.parametrize("kv", QUANTIZED)
def test_logprobs_and_greedy_tokens_close_to_the_float32_oracle(qknorm_dir, oracle, kv):
    prompts = _prompts()
    want = _prompt_logprobs(oracle, prompts)
    llm = _llm(qknorm_dir, kv_cache_dtype=kv)
    got = _prompt_logprobs(llm, prompts)
    diffs = torch.tensor([w[t].logprob - g[t].logprob for p, ws, gs in zip(prompts, want, got)
                          for t, w, g in zip(p[1:], ws, gs)]).abs()
    worst, mean = TOLERANCE[kv]
    assert diffs.max() <= worst and diffs.mean() <= mean, (diffs.max(), diffs.mean())
    assert diffs.max() > 0  # the cache really was quantized
    # Greedy: every token the quantized engine picks is one the oracle ranks within the tolerance
    # of its own best at that position (a near-tie may break the other way, nothing more).
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    paths = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    judged = _prompt_logprobs(oracle, paths, top=1)
    for prompt, path, lps in zip(prompts, paths, judged):
        for pos in range(len(prompt), len(path)):
            position = lps[pos - 1]
            best = max(lp.logprob for lp in position.values())
            assert best - position[path[pos]].logprob <= worst


@pytest.mark.parametrize("kv", QUANTIZED)
def test_fast_path_equals_the_oracle_on_the_same_quantized_cache(qknorm_dir, kv):
    """Equal up to float rounding, except that rounding, reaching a later layer's keys, can move an
    isolated code across a rounding boundary: one step of one number, far below TOLERANCE."""
    prompts = _prompts((9, 33, 50))
    ref = _llm(qknorm_dir, kv_cache_dtype=kv, attention_backend="torch_reference")
    fast = _llm(qknorm_dir, kv_cache_dtype=kv)
    assert [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)] == \
           [o.outputs[0].token_ids for o in fast.generate(prompts, GREEDY)]
    for a, b in zip(_prompt_logprobs(ref, prompts), _prompt_logprobs(fast, prompts)):
        for x, y in zip(a, b):
            assert abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob) < 1e-2


def _greedy(model_dir, prompts, **kw):
    llm = _llm(model_dir, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], llm.llm_engine


@pytest.mark.parametrize("kv", QUANTIZED)
def test_prefix_hits_and_preemption_do_not_change_tokens(llama_dir, kv):
    system = _prompts((40,), seed=11)[0]
    prompts = [system + tail for tail in _prompts((3, 9, 17, 30), seed=12)]
    baseline, _ = _greedy(llama_dir, prompts, kv_cache_dtype=kv, enable_prefix_caching=False)
    # Prefix hits: the shared 40 tokens' blocks are read back, codes and scales, by later requests.
    llm = _llm(llama_dir, kv_cache_dtype=kv)
    one_by_one = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in one_by_one] == baseline
    assert [o.num_cached_tokens for o in one_by_one][1:] == [32, 32, 32]

    # 9 blocks of 16 cannot hold these six requests at once: preempt by recompute and by swap.
    prompts = _prompts((1, 9, 16, 31, 50, 70), seed=7)
    baseline, _ = _greedy(llama_dir, prompts, kv_cache_dtype=kv)
    for mode in ("recompute", "swap"):
        tokens, engine = _greedy(llama_dir, prompts, kv_cache_dtype=kv, num_kv_blocks=9, preemption_mode=mode,
                                 swap_space_gb=0.01)
        assert engine.scheduler.num_preemptions_total > 0
        assert tokens == baseline, mode
        assert engine.kv_cache_usage == 0.0


def test_the_same_memory_holds_more_tokens(llama_dir):
    # llama-gqa: 2 layers x 2 KV heads x 16 dims. A token costs 2*2*2*16*4 = 512 bytes in float32
    # and 2*2*2*(16 + 2) = 144 bytes quantized (a 2-byte scale per 16 codes): 3.56x the tokens.
    budget = 9.2e-5  # GB: 12 float32 blocks of 16 tokens
    engines = {kv: LLMEngine(EngineArgs(model=llama_dir, dtype="float32", skip_tokenizer_init=True,
                                        kv_cache_memory_gb=budget, kv_cache_dtype=kv, disable_log_stats=True))
               for kv in ("auto", *QUANTIZED)}
    bytes_budget = int(budget * 1024**3)
    assert engines["auto"].num_kv_blocks == bytes_budget // (512 * 16) == 12
    assert [engines[kv].num_kv_blocks for kv in QUANTIZED] == [bytes_budget // (144 * 16)] * len(QUANTIZED) == [42] * 3
    # The planner counts the same bytes the pool does.
    spec = ModelSpec.from_arch(engines["fp8"].arch)
    assert [spec.kv_bytes_per_token("float32", kv) for kv in QUANTIZED] == [144] * len(QUANTIZED)
    assert spec.kv_bytes_per_token("float32") == 512
    # A request of 13 blocks can never run in the float32 pool, and runs alone in the quantized one.
    prompt = _prompts((200,), seed=5)[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="needs 13 KV blocks .* has 12"):
        engines["auto"].add_request("r", {"prompt_token_ids": prompt}, params)
    for kv in QUANTIZED:
        engine = engines[kv]
        engine.add_request("r", {"prompt_token_ids": prompt}, params)
        used = []
        while engine.has_unfinished_requests():
            engine.step()
            used.append(engine.kv_cache_usage)
        assert engine.scheduler.num_preemptions_total == 0
        assert max(used) == 13 / 42  # kv_cache_usage: a fraction of the bigger pool


def test_bad_kv_cache_dtype_is_a_clear_error(llama_dir, capsys):
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, fp8, fp8_e4m3, fp8_e5m2 or int8"):
        EngineArgs(model=llama_dir, kv_cache_dtype="fp4").create_config(512)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _llm(llama_dir, kv_cache_dtype="fp4")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp4"])
    assert "--kv-cache-dtype: invalid choice: 'fp4'" in capsys.readouterr().err
    for kv in QUANTIZED:
        with pytest.raises(ValueError, match=f"kv_cache_dtype={kv} is not implemented by the triton"):
            EngineArgs(model=llama_dir, kv_cache_dtype=kv, attention_backend="triton").create_config(512)


def test_vllms_fp8_e4m3_is_fp8(llama_dir):
    """vLLM's name for the E4M3 codes is taken as "fp8": the same pool, the same tokens."""
    outputs = {}
    for kv in ("fp8", "fp8_e4m3"):
        engine = LLMEngine(EngineArgs(model=llama_dir, dtype="float32", skip_tokenizer_init=True, kv_cache_dtype=kv,
                                      num_kv_blocks=32, disable_log_stats=True))
        assert engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
        engine.add_request("r", {"prompt_token_ids": _prompts((40,), seed=2)[0]},
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[kv] = out.outputs[0].token_ids
    assert outputs["fp8_e4m3"] == outputs["fp8"]


def test_fp8_e5m2_stores_e5m2_codes_from_the_flag_on(llama_dir):
    """vLLM's `--kv-cache-dtype fp8_e5m2`: accepted on the command line, a pool of E5M2 codes (the
    bytes of fp8's), and tokens of its own: E5M2 rounds otherwise than E4M3."""
    args = build_parser().parse_args(["generate", "hi", "--model", llama_dir, "--kv-cache-dtype", "fp8_e5m2"])
    assert EngineArgs.from_cli_args(args).kv_cache_dtype == "fp8_e5m2"
    logprobs, caches = {}, {}
    for kv in ("fp8", "fp8_e5m2"):
        engine = LLMEngine(EngineArgs(model=llama_dir, dtype="float32", skip_tokenizer_init=True, kv_cache_dtype=kv,
                                      num_kv_blocks=32, disable_log_stats=True))
        caches[kv] = engine.runner.kv_caches[0]
        engine.add_request("r", {"prompt_token_ids": _prompts((40,), seed=2)[0]},
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))
        while engine.has_unfinished_requests():
            for out in engine.step():
                logprobs[kv] = [lp.logprob for step in out.outputs[0].logprobs for lp in step.values()]
    assert caches["fp8_e5m2"].dtype == torch.float8_e5m2
    assert caches["fp8_e5m2"].shape == caches["fp8"].shape
    assert logprobs["fp8_e5m2"] != logprobs["fp8"]


def test_mla_latent_cache_refuses_quantization(tmp_path):
    make_tiny_model("deepseek-v2", tmp_path)
    for kv in ("int8", "fp8_e5m2"):
        with pytest.raises(ValueError, match="kv_cache_dtype fp8/int8 is not implemented for multi-head latent"):
            _llm(str(tmp_path), kv_cache_dtype=kv)
