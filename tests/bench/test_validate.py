"""`kvflow plan --validate`: roofline predictions of W1/W2, then the real runs."""

from __future__ import annotations

import json

import pytest
from tiny_models import make_tiny_model

from kvflow.analysis.model_spec import PRESETS
from kvflow.bench import validate as validate_mod
from kvflow.bench.ceilings import Ceilings
from kvflow.bench.latency import LatencyWorkload
from kvflow.bench.mbu import EngineShape
from kvflow.bench.throughput import ThroughputWorkload
from kvflow.bench.validate import Check, engine_model, predict_latency, predict_throughput
from kvflow.entrypoints.plan_cli import main_plan

SHAPE = EngineShape(PRESETS["smollm2-135m"], "bfloat16", 2, "cpu")
CEILINGS = Ceilings(memory_bandwidth_gb_s=10.0, peak_flops=1e12, dtype="bfloat16", device="cpu")
STEP_WEIGHT_BYTES = 269_030_016  # SmolLM2-135M in bf16 (see tests/bench/test_mbu.py)
KV_PER_TOKEN = 23_040


def test_w2_prediction_by_hand():
    ttft_s, decode_tok_s = predict_latency(SHAPE, LatencyWorkload(), CEILINGS)
    # Prefill of 32 tokens reads the weights and writes 32 tokens of KV: memory-bound at
    # 10 GB/s (6.9 GFLOP at 1 TFLOP/s would take only 6.9 ms).
    assert ttft_s == pytest.approx((STEP_WEIGHT_BYTES + 32 * KV_PER_TOKEN) / 10e9)
    # 127 decode steps attending to 33..159 positions, each memory-bound.
    decode_bytes = 127 * STEP_WEIGHT_BYTES + sum(range(33, 160)) * KV_PER_TOKEN
    assert decode_tok_s == pytest.approx(127 / (decode_bytes / 10e9))


def test_w1_prediction_counts_steps_and_waves():
    # Two prompts of 100 tokens, budget 64 → 4 prefill steps; max 1 sequence → 2 waves of 2 steps.
    seconds = predict_throughput(SHAPE, [100, 100], 3, token_budget=64, max_seqs=1, ceilings=CEILINGS)
    prefill_bytes = 4 * STEP_WEIGHT_BYTES + 200 * KV_PER_TOKEN
    decode_bytes = 4 * STEP_WEIGHT_BYTES + 2 * (101 + 102) * KV_PER_TOKEN
    assert seconds == pytest.approx((prefill_bytes + decode_bytes) / 10e9)


def test_check_attained_reads_like_a_utilization():
    assert Check("rate", 100.0, 25.0, True).attained == 0.25
    assert Check("time", 10.0, 40.0, False).attained == 0.25


def test_engine_model_resolution(tmp_path):
    assert engine_model("default") is None and engine_model("SmolLM2-135M") is None
    assert engine_model(str(tmp_path / "config.json")) == str(tmp_path)
    with pytest.raises(ValueError, match="must be the default or a checkpoint"):
        engine_model("llama-2-7b")


def test_plan_validate_runs_tiny_w1_w2(tmp_path, monkeypatch, capsys):
    make_tiny_model("llama-mha-tied", tmp_path / "tiny")
    ceilings = tmp_path / "ceilings.json"
    ceilings.write_text(json.dumps(CEILINGS.to_json()))
    # The real W1/W2 take minutes on 2 cores; the same code path on a handful of tokens.
    monkeypatch.setattr(validate_mod, "W1", ThroughputWorkload(num_prompts=3, min_input_len=4, max_input_len=20,
                                                               output_len=4))
    monkeypatch.setattr(validate_mod, "W2", LatencyWorkload(input_len=6, output_len=4, num_iters=1))
    argv = ["--validate", "--model", str(tmp_path / "tiny"), "--ceilings-json", str(ceilings)]
    assert main_plan([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    names = [c["name"] for c in result["checks"]]
    assert names == ["W1 output tok/s", "W1 total tok/s", "W2 TTFT ms (6 tokens)", "W2 decode tok/s"]
    assert all(c["predicted"] > 0 and c["measured"] > 0 and c["attained"] > 0 for c in result["checks"])
    assert result["w1"]["output_tokens"] == 12 and 0 < result["w2"]["mbu"] <= 1
    assert result["checks"][0]["measured"] == result["w1"]["output_tok_s"]
    assert "W2 decode tok/s" in validate_mod.format_validation(result)


def test_plan_validate_refuses_a_preset_it_cannot_run(capsys):
    assert main_plan(["--validate", "--model", "llama-2-7b"]) == 2
    assert "must be the default or a checkpoint" in capsys.readouterr().err
