"""benchmarks/gpu_bench.py end to end on CPU: a tiny Llama config, a handful of short requests.

The GPU run itself needs an H100; this proves the orchestration, the token accounting and the
report on any machine. Ceilings come from a file (fixed, round numbers) so MBU can be recomputed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import COMMON

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_bench.py"
CEILINGS = {"memory_bandwidth_gb_s": 1.0, "peak_flops": 1e9, "dtype": "bfloat16", "device": "cpu"}
WORKLOAD = ["--num-requests", "5", "--min-len", "3", "--max-len", "9", "--latency-input-len", "4",
            "--latency-output-len", "6", "--latency-iters", "1", "--hf-batch-size", "2"]


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_bench():
    return load_script()


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    directory = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    config.to_json_file(directory / "config.json")
    return directory


@pytest.fixture(scope="module")
def run(tiny_config, tmp_path_factory):
    """One whole run; HF's throughput cap is 0 s, so it runs exactly one batch and must say so."""
    tmp = tmp_path_factory.mktemp("gpu-bench")
    ceilings = tmp / "ceilings.json"
    ceilings.write_text(json.dumps(CEILINGS))
    out = tmp / "out"
    argv = ["--out", str(out), "--device", "cpu", "--model", str(tiny_config), "--ceilings-json", str(ceilings),
            *WORKLOAD, "--hf-throughput-cap-s", "0", "--budget-s", "300", "--hf-reserve-s", "120"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300,
                          check=False)
    log = (out / "gpu_bench.log").read_text() if (out / "gpu_bench.log").is_file() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log
    return {"argv": argv, "out": out, "stdout": proc.stdout, "log": log,
            "report": json.loads((out / "gpu_bench.json").read_text())}


def test_every_phase_finished(run):
    r = run["report"]
    assert r["kvflow"]["phase"]["rc"] == 0 and r["hf"]["phase"]["rc"] == 0, run["log"]
    assert r["ceilings"] == CEILINGS


def test_kvflow_made_exactly_the_tokens_asked(run, gpu_bench):
    args = gpu_bench.parse_args(run["argv"])
    prompts, output_lens = gpu_bench.throughput_workload(args, COMMON["vocab_size"])
    t = run["report"]["kvflow"]["throughput"]
    assert t["complete"] and t["num_requests"] == t["num_requests_finished"] == 5
    assert t["output_tokens"] == t["output_tokens_asked"] == sum(output_lens)
    assert t["prompt_tokens"] == sum(len(p) for p in prompts)
    assert all(3 <= n <= 9 for n in output_lens) and all(3 <= len(p) <= 9 for p in prompts)
    assert t["output_tok_s"] == pytest.approx(t["output_tokens"] / t["elapsed_s"])
    assert 0 < t["mbu"] < 1 and 0 < t["mfu"] < 1


def test_kvflow_batch1_mbu_is_the_decode_bytes_over_the_ceiling(run, gpu_bench, tiny_config):
    from kvflow.bench.mbu import latency_decode_work, spec_from_arch

    lat = run["report"]["kvflow"]["latency"]
    work = latency_decode_work(spec_from_arch(gpu_bench.arch_of(str(tiny_config))), 4, 6, 2)
    decode_s = (6 - 1) / lat["decode_tok_s"]
    assert lat["mbu"] == pytest.approx(work.bytes / decode_s / 1e9)
    assert run["report"]["goal"]["batch1_mbu"] == lat["mbu"]


def test_hf_stops_at_its_cap_and_counts_only_useful_tokens(run, gpu_bench):
    args = gpu_bench.parse_args(run["argv"])
    prompts, output_lens = gpu_bench.throughput_workload(args, COMMON["vocab_size"])
    t = run["report"]["hf"]["throughput"]
    # A 0 s cap still runs the first batch of 2, then starts no other.
    assert not t["complete"] and t["num_requests"] == 5 and t["num_requests_finished"] == 2
    assert t["output_tokens"] == sum(output_lens[:2])
    assert t["generated_tokens"] == 2 * max(output_lens[:2])
    assert t["prompt_tokens"] == sum(len(p) for p in prompts[:2])
    assert run["report"]["hf"]["latency"]["decode_tok_s"] > 0


def test_ratios_are_kvflow_over_hf(run):
    r = run["report"]
    ratios, kv, hf = r["ratios_kvflow_over_hf"], r["kvflow"], r["hf"]
    assert ratios["decode_tok_s"] == pytest.approx(kv["latency"]["decode_tok_s"] / hf["latency"]["decode_tok_s"])
    assert ratios["throughput_output_tok_s"] == pytest.approx(
        kv["throughput"]["output_tok_s"] / hf["throughput"]["output_tok_s"])
    assert r["goal"]["ahead_of_hf_throughput"] == (ratios["throughput_output_tok_s"] > 1)


def test_markdown_reports_the_ratio_and_the_cut(run):
    md = (run["out"] / "gpu_bench.md").read_text()
    assert f"**{run['report']['ratios_kvflow_over_hf']['decode_tok_s']:.2f}×**" in md
    assert "2 of 5 (stopped at its 0 s cap)" in md and "5 of 5 |" in md
    assert md in run["stdout"]


def test_kvflow_past_its_cap_aborts_and_says_so(gpu_bench, tiny_config):
    from kvflow import LLM
    from kvflow.bench.ceilings import Ceilings

    llm = LLM(model=str(tiny_config), load_format="dummy", skip_tokenizer_init=True, device="cpu",
              dtype="float32", max_model_len=32, disable_log_stats=True)
    t = gpu_bench.kvflow_throughput(llm, [[5, 6, 7]] * 3, [4, 4, 4], 0.0, Ceilings(1.0, 1e9, "float32", "cpu"), "cpu")
    assert not t["complete"] and t["num_requests_finished"] == 0 and t["output_tokens"] == 0
    assert not llm.llm_engine.has_unfinished_requests()  # the aborted requests are gone, not left queued
