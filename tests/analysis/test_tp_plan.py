"""The tensor-parallel estimate: collective counts and sizes by hand, one device equals the plain
roofline, and the model's form against gpt-fast's published 8xA100 scaling."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvflow.analysis.hardware import PRESETS as HARDWARE
from kvflow.analysis.model_spec import PRESETS as MODELS
from kvflow.analysis.planner import plan
from kvflow.analysis.tensor_parallel import (
    allgather_seconds,
    allreduce_seconds,
    kv_fraction_per_rank,
    tensor_parallel_estimate,
)
from kvflow.entrypoints.plan_cli import main_plan

H100 = HARDWARE["H100-SXM"]
A100 = HARDWARE["A100-80GB"]
LLAMA_70B = MODELS["llama-3.1-70b"]


def test_link_figures_are_the_datasheets_halved():
    # NVLink both ways together: 600 GB/s on A100 (seed 000:67), 900 GB/s on H100 (000:91).
    assert A100.interconnect_bandwidth == 300e9
    assert H100.interconnect_bandwidth == 450e9


def test_ring_collectives_by_hand():
    # 8 ranks, 1 MB: each link carries 2·7/8 MB (all-reduce) or 7/8 MB (all-gather).
    assert allreduce_seconds(1e6, 8, 1e9, 0.0) == pytest.approx(1.75e-3)
    assert allgather_seconds(1e6, 8, 1e9, 0.0) == pytest.approx(0.875e-3)
    assert allreduce_seconds(1e6, 8, 1e9, 5e-6) == pytest.approx(1.755e-3)
    assert allreduce_seconds(1e6, 1, 1e9, 5e-6) == 0.0


def test_one_device_is_the_plain_roofline():
    tp = tensor_parallel_estimate(LLAMA_70B, H100, 1, "bfloat16", 16, (1, 64), 1024)
    rows = plan(LLAMA_70B, H100, batch_sizes=(1, 64), context_len=1024).rows
    for tp_row, row in zip(tp.rows, rows, strict=True):
        assert tp_row.comm_ms == 0.0
        assert tp_row.latency_ms == pytest.approx(row.latency_ms)
        assert tp_row.speedup == pytest.approx(1.0)
    assert not tp.rows[0].fits  # 141 GB of bf16 weights on one 80 GB device


def test_eight_h100s_decode_llama_70b():
    tp = tensor_parallel_estimate(LLAMA_70B, H100, 8, "bfloat16", 16, (1,), 1024, allreduce_latency_s=10e-6)
    row = tp.rows[0]
    assert tp.allreduces_per_step == 161  # 2 per layer + the embedding's
    # Batch 1: 161 all-reduces of 8192 bf16 numbers and a float32 logits gather, each 10 µs
    # plus the bytes over 450 GB/s.
    act = 8192 * 2
    expected = 161 * (10e-6 + 1.75 * act / 450e9) + 10e-6 + 0.875 * 128256 * 4 / 450e9
    assert row.comm_ms == pytest.approx(expected * 1e3)
    # Each rank reads an eighth of the weights and of the KV (8 KV heads, one per rank).
    assert tp.kv_fraction_per_rank == 0.125
    assert row.compute_ms == pytest.approx(LLAMA_70B.weight_bytes(16) / 8 / H100.memory_bandwidth * 1e3, rel=0.01)
    assert row.fits and 5 < row.speedup < 8
    # Prefill moves [1024, 8192] activations: bandwidth, not latency, sets its collectives.
    assert tp.prefill.comm_ms > 161 * 1.75 * 1024 * act / 450e9 * 1e3


def test_fewer_kv_heads_than_ranks_keep_one_head_each():
    assert kv_fraction_per_rank(LLAMA_70B, 16) == 1 / 8
    assert kv_fraction_per_rank(LLAMA_70B, 4) == 1 / 4
    assert kv_fraction_per_rank(MODELS["deepseek-v2"], 8) == 1.0  # MLA's latent is not split


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="does not divide"):
        tensor_parallel_estimate(MODELS["smollm2-135m"], H100, 2, "bfloat16", 16, (1,), 128)
    with pytest.raises(ValueError, match="no device-to-device link"):
        tensor_parallel_estimate(LLAMA_70B, replace(H100, interconnect_bandwidth=None), 8, "bfloat16", 16, (1,), 128)
    with pytest.raises(ValueError, match=">= 1"):
        tensor_parallel_estimate(LLAMA_70B, H100, 0, "bfloat16", 16, (1,), 128)


def test_form_matches_gpt_fast_published_a100_scaling():
    """gpt-fast's README: Llama-2-70B at batch 1 on 8xA100-80GB (power-limited, ~1,700 GB/s
    usable): 21.32 / 38.01 / 62.50 tok/s at 2 / 4 / 8 GPUs. Time per token = a/N + c fits
    them: from N = 2 and 8, a = 82.4 ms (138 GB at 1,675 GB/s) and c = 5.7 ms (≈ 36 µs for
    each of 160 all-reduces); N = 4 is then predicted, not fitted."""
    published = {2: 21.32, 4: 38.01, 8: 62.50}
    a100 = replace(A100, memory_bandwidth=1675e9)
    model = MODELS["llama-2-70b"]
    for n, tok_s in published.items():
        tp = tensor_parallel_estimate(model, a100, n, "bfloat16", 16, (1,), 5, allreduce_latency_s=36e-6)
        assert tp.rows[0].throughput_tok_s == pytest.approx(tok_s, rel=0.04), n


def test_cli_prints_and_exports_the_estimate(capsys):
    assert main_plan(["--model", "llama-3.1-70b", "--tensor-parallel-size", "8", "--batch-sizes", "1,64"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel over 8 devices" in out and "comm ms" in out
    assert main_plan(["--model", "llama-3.1-70b", "-tp", "8", "--allreduce-latency-us", "20", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tensor_parallel"]["size"] == 8
    assert data["tensor_parallel"]["allreduce_latency_s"] == pytest.approx(20e-6)
    assert main_plan(["--model", "smollm2-135m", "-tp", "2"]) == 2
    assert "does not divide" in capsys.readouterr().err
