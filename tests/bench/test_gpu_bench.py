"""benchmarks/gpu_bench.py end to end on CPU: a tiny Llama config, a handful of short requests;
and `kvflow.bench.throughput.generate_counting_steps`, its kvflow throughput loop.

The GPU run itself needs an H100; this proves the orchestration, the token accounting and the
report on any machine. Ceilings come from a file (fixed, round numbers) so MBU can be recomputed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import COMMON

from kvflow.bench import throughput
from kvflow.bench.ceilings import Ceilings
from kvflow.bench.throughput import generate_counting_steps
from kvflow.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_bench.py"
CEILINGS = {"memory_bandwidth_gb_s": 1.0, "peak_flops": 1e9, "dtype": "bfloat16", "device": "cpu", "peak_product": ""}
WORKLOAD = ["--num-requests", "5", "--min-len", "3", "--max-len", "9", "--latency-input-len", "4",
            "--latency-output-len", "6", "--latency-iters", "1", "--hf-batch-size", "2"]
GREEDY = SamplingParams(temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.fixture(scope="module")
def gpu_bench():
    """The script, loaded by its path; that puts benchmarks/ on sys.path, for its own modules."""
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_phase(gpu_bench):
    return importlib.import_module("gpu_phase")


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    directory = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    config.to_json_file(directory / "config.json")
    return directory


@pytest.fixture(scope="module")
def engine(tiny_config):
    from kvflow import LLM

    return LLM(model=str(tiny_config), load_format="dummy", skip_tokenizer_init=True, device="cpu",
               dtype="float32", max_model_len=32, disable_log_stats=True).llm_engine


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


def test_kvflow_made_exactly_the_tokens_asked(run, gpu_bench, gpu_phase):
    args = gpu_bench.parse_args(run["argv"])
    prompts, output_lens = gpu_phase.throughput_workload(args, COMMON["vocab_size"])
    t = run["report"]["kvflow"]["throughput"]
    assert t["complete"] and t["num_requests"] == t["num_requests_finished"] == 5 and t["num_requests_aborted"] == 0
    assert t["output_tokens"] == t["output_tokens_asked"] == sum(output_lens)
    assert t["prompt_tokens"] == sum(len(p) for p in prompts)
    assert all(3 <= n <= 9 for n in output_lens) and all(3 <= len(p) <= 9 for p in prompts)
    assert t["output_tok_s"] == pytest.approx(t["output_tokens"] / t["elapsed_s"])
    # (Against this test's made-up ceilings a fast run can pass 100%: only the sign is the report's.)
    assert t["mbu"] > 0 and t["mfu"] > 0


def test_kvflow_batch1_mbu_is_the_decode_bytes_over_the_ceiling(run, gpu_phase, tiny_config):
    from kvflow.analysis.model_spec import ModelSpec
    from kvflow.bench.mbu import latency_decode_work

    lat = run["report"]["kvflow"]["latency"]
    work = latency_decode_work(ModelSpec.from_arch(gpu_phase.arch_of(str(tiny_config))), 4, 6, 2)
    decode_s = (6 - 1) / lat["decode_tok_s"]
    assert lat["mbu"] == pytest.approx(work.bytes / decode_s / 1e9)
    assert run["report"]["goal"]["batch1_mbu"] == lat["mbu"]


def test_hf_stops_at_its_cap_and_counts_only_useful_tokens(run, gpu_bench, gpu_phase):
    args = gpu_bench.parse_args(run["argv"])
    prompts, output_lens = gpu_phase.throughput_workload(args, COMMON["vocab_size"])
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


def test_kvflow_past_its_cap_aborts_and_says_so(gpu_bench, engine):
    gpu_kvflow = importlib.import_module("gpu_kvflow")
    t = gpu_kvflow.kvflow_throughput(engine, PROMPTS, [4, 4, 4], 0.0, Ceilings(1.0, 1e9, "float32", "cpu"), "cpu")
    assert not t["complete"] and t["num_requests_finished"] == 0 and t["output_tokens"] == 0
    assert t["num_requests_aborted"] == 3
    assert not engine.has_unfinished_requests()  # the aborted requests are gone, not left queued


def test_counting_steps_gives_each_prompt_its_own_output_length(engine):
    run = generate_counting_steps(engine, PROMPTS, [GREEDY.clone(max_tokens=n) for n in (2, 5, 3)])
    assert run.output_lens == [2, 5, 3] and run.aborted == [False] * 3
    assert run.steps == 5  # the first step prefills all three and samples their first tokens
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        generate_counting_steps(engine, PROMPTS, [GREEDY, GREEDY])
    assert not engine.has_unfinished_requests()


def test_counting_steps_aborts_what_is_unfinished_at_its_deadline(engine, monkeypatch):
    """The clock reads the engine steps taken, so a deadline of 2.5 passes after exactly 3 steps."""
    steps, step = [0], engine.step

    def counted_step():
        steps[0] += 1
        return step()

    monkeypatch.setattr(engine, "step", counted_step)
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=lambda: steps[0]))
    run = generate_counting_steps(engine, PROMPTS, [GREEDY.clone(max_tokens=n) for n in (2, 5, 3)], deadline=2.5)
    # The third request finishes in step 3; only the second, 3 of its 5 tokens made, is cut.
    assert run.steps == 3 and run.output_lens == [2, 3, 3] and run.aborted == [False, True, False]
    assert not engine.has_unfinished_requests()
