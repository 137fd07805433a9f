"""MBU / MFU bookkeeping: byte and FLOP counts against hand arithmetic on SmolLM2-135M's shape,
and `kvflow bench throughput|latency --json` reporting them on a tiny model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from tiny_models import make_tiny_model

from kvflow.analysis.model_spec import PRESETS, ModelSpec
from kvflow.bench.ceilings import Ceilings
from kvflow.bench.mbu import (
    Work,
    batch_work,
    decode_token_work,
    get_ceilings,
    latency_decode_work,
    load_ceilings,
    prefill_work,
    roofline_seconds,
    step_weight_bytes,
    utilization,
)
from kvflow.model.arch_config import ArchConfig

SMOLLM2 = PRESETS["smollm2-135m"]
BF16 = 2
# SmolLM2-135M (config.json): 30 layers, hidden 576, 9 query / 3 KV heads of 64, MLP 1536,
# vocabulary 49152, tied embeddings.
ATTN = 576 * 9 * 64 * 2 + 576 * 3 * 64 * 2  # q, o + k, v = 884,736
MLP = 3 * 576 * 1536  # gate, up, down = 2,654,208
LAYERS = 30 * (ATTN + MLP)  # 106,168,320
NORMS = 30 * 2 * 576 + 576  # 35,136
LM_HEAD = 49152 * 576  # 28,311,552 (the tied embedding)
STEP_WEIGHT_BYTES = (LAYERS + NORMS + LM_HEAD) * BF16  # 269,030,016
KV_PER_TOKEN = 30 * 2 * 3 * 64 * BF16  # 23,040
DECODE_FLOPS = 2 * (LAYERS + LM_HEAD)  # 2 per weight of every matmul a token passes
ATTN_FLOPS_PER_POSITION = 30 * 2 * 9 * (64 + 64)  # QK^T and PV, per attended position


def test_step_weight_bytes_are_every_matmul_weight_once():
    assert step_weight_bytes(SMOLLM2, BF16) == STEP_WEIGHT_BYTES
    # Untying adds an input table that a step only gathers rows of: no more bytes per step.
    assert step_weight_bytes(replace(SMOLLM2, tie_embeddings=False), BF16) == STEP_WEIGHT_BYTES


def test_decode_and_prefill_work():
    expected = Work(100 * KV_PER_TOKEN, DECODE_FLOPS + 100 * ATTN_FLOPS_PER_POSITION)
    assert decode_token_work(SMOLLM2, 100, BF16) == expected
    # A 32-token prefill: every token through every layer, the LM head once, 32·33/2 causal pairs.
    flops = 2 * LAYERS * 32 + 2 * LM_HEAD + 32 * 33 // 2 * ATTN_FLOPS_PER_POSITION
    assert prefill_work(SMOLLM2, 32, BF16) == Work(32 * KV_PER_TOKEN, flops)


def test_latency_and_batch_work():
    # Prompt 32, 4 output tokens: 3 decode steps attending to 33, 34, 35 positions.
    assert latency_decode_work(SMOLLM2, 32, 4, BF16) == Work(
        3 * STEP_WEIGHT_BYTES + (33 + 34 + 35) * KV_PER_TOKEN,
        3 * DECODE_FLOPS + (33 + 34 + 35) * ATTN_FLOPS_PER_POSITION,
    )
    # Requests (10 prompt, 3 out) and (20, 1) in 5 steps: two prefills, decodes at 11 and 12.
    got = batch_work(SMOLLM2, [(10, 3), (20, 1)], 5, BF16)
    prefill_flops = 2 * LAYERS * 30 + 2 * 2 * LM_HEAD + (55 + 210) * ATTN_FLOPS_PER_POSITION
    assert got == Work(
        5 * STEP_WEIGHT_BYTES + (10 + 20 + 11 + 12) * KV_PER_TOKEN,
        prefill_flops + 2 * DECODE_FLOPS + (11 + 12) * ATTN_FLOPS_PER_POSITION,
    )


def test_utilization_and_roofline():
    ceilings = Ceilings(memory_bandwidth_gb_s=10.0, peak_flops=1e10, dtype="bfloat16", device="cpu")
    u = utilization(Work(1e9, 2e9), 2.0, ceilings)
    assert (u.mbu, u.mfu) == pytest.approx((0.05, 0.1))
    assert u.describe() == "MBU 5%   MFU 10%"
    assert roofline_seconds(Work(1e9, 2e9), ceilings) == pytest.approx(0.2)  # compute-bound
    assert roofline_seconds(Work(1e10, 2e9), ceilings) == pytest.approx(1.0)  # memory-bound


def test_the_planner_reads_the_engines_kv_layout():
    smollm2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
               "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
               "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}
    qwen2_hybrid = {**smollm2, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                    "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 10}
    shared = {**smollm2, "num_kv_shared_layers": 10}
    for config in (smollm2, qwen2_hybrid, shared):
        arch = ArchConfig.from_hf(config)
        spec = ModelSpec.from_arch(arch)
        assert spec.layer_kv_specs() == arch.kv_cache_specs()
        assert spec.kv_bytes_per_token(16) == arch.kv_layout.block_bytes(1, 2) * len(arch.kv_layout.groups)
    assert ModelSpec.from_hf_config(qwen2_hybrid).global_layers == tuple(range(10))
    assert ModelSpec.from_hf_config(shared).kv_bytes_per_token() == 20 * 2 * 3 * 64 * 2  # 10 of 30 layers read others'


def test_ceilings_file(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"memory_bandwidth_gb_s": 5, "peak_flops": 1e11, "dtype": "float32", "device": "cpu"}))
    assert load_ceilings(path) == Ceilings(5.0, 1e11, "float32", "cpu")
    assert get_ceilings(str(path), "bfloat16", "cpu").peak_flops == 1e11
    assert "measured in float32" in capsys.readouterr().err
    path.write_text("{}")
    with pytest.raises(ValueError, match="kvflow bench ceilings"):
        load_ceilings(path)


# ---- the bench commands report MBU and MFU ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


@pytest.fixture
def ceilings_json(tmp_path):
    # Fixed, modest ceilings (no measuring, so the test is fast): a tiny model's run moves far
    # less than 10 GB/s and does far less than 10 GFLOP/s, so both fractions land in (0, 1].
    path = tmp_path / "ceilings.json"
    fixed = Ceilings(memory_bandwidth_gb_s=10.0, peak_flops=1e10, dtype="bfloat16", device="cpu")
    path.write_text(json.dumps(fixed.to_json()))
    return str(path)


@pytest.mark.parametrize("bench", [
    ["throughput", "--num-prompts", "5", "--min-input-len", "4", "--max-input-len", "30", "--output-len", "4"],
    ["latency", "--input-len", "8", "--output-len", "5", "--num-iters", "2"],
])
def test_bench_json_reports_mbu_and_mfu(bench, tiny_dir, ceilings_json, capsys):
    from kvflow.entrypoints.cli import main

    argv = ["bench", *bench, "--model", tiny_dir, "--skip-tokenizer-init", "--ceilings-json", ceilings_json, "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < result["mbu"] <= 1 and 0 < result["mfu"] <= 1
    assert result["ceilings"]["memory_bandwidth_gb_s"] == 10.0
    if bench[0] == "throughput":
        assert result["num_steps"] >= 4 and result["output_tokens"] == 20


def test_weights_count_as_the_engine_holds_them(tiny_dir):
    """A float model: the parameter count says it (None). The default GGUF: what a decode step
    reads, counted by hand from SmolLM2's shapes: Q4_1 layers at 16 bytes of codes and 4 of
    (scale, zero) per group of 32 (the GEMV's layout; aten's planes where there is none), the
    tied Q8_0 head at 32 + 4, the norms in bf16."""
    from kvflow.bench.mbu import held_weight_bytes
    from kvflow.config import EngineArgs
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.quant import int4_gemv

    small = dict(skip_tokenizer_init=True, disable_log_stats=True, num_kv_blocks=16)
    assert held_weight_bytes(LLMEngine(EngineArgs(tiny_dir, dtype="float32", **small)).runner.model) is None
    gguf = LLMEngine(EngineArgs(dtype="bfloat16", **small)).runner.model
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down
    if int4_gemv.fast():
        layers = 30 * sum(n * (k // 32) * (16 + 4) for n, k in shapes)
        head = 49152 * (576 // 32) * (32 + 4)
    else:  # int4 planes: K / 2 bytes a row and a bf16 (scale, zero) per group, per plane
        layers = 30 * sum(n * k // 2 + n * (k // 32) * 4 for n, k in shapes)
        head = 2 * (49152 * 576 // 2 + 49152 * (576 // 32) * 4)
    norms = (30 * 2 + 1) * 576 * 2
    assert held_weight_bytes(gguf) == layers + head + norms


def test_throughput_is_timed_after_the_engine_warms_up_as_a_server_does(tiny_dir, monkeypatch):
    from kvflow.bench import throughput
    from kvflow.config import EngineArgs
    from kvflow.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=tiny_dir, skip_tokenizer_init=True, max_model_len=128))
    order = []
    warm_up, timed = engine.warm_up, throughput.generate_counting_steps
    monkeypatch.setattr(engine, "warm_up", lambda: (order.append("warm_up"), warm_up())[1])
    monkeypatch.setattr(throughput, "generate_counting_steps",
                        lambda e, prompts, *a, **k: (order.append(len(prompts)), timed(e, prompts, *a, **k))[1])
    workload = throughput.ThroughputWorkload(num_prompts=3, min_input_len=4, max_input_len=20, output_len=3)
    result = throughput.measure_throughput(engine, workload, Ceilings(10.0, 1e10, "float32", "cpu"))
    assert order == ["warm_up", 2, 3]  # the warm-up, a short run, then the timed one
    assert result["output_tokens"] == workload.num_prompts * workload.output_len
