"""The `kvflow` command as a user runs it: a real process, real stdin/stdout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_models import make_tiny_model

KVFLOW = [sys.executable, "-m", "kvflow.entrypoints.cli"]


def run(args: list[str], stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(KVFLOW + args, input=stdin, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama-gqa-llama3-rope", path)
    return str(path)


@pytest.mark.slow
def test_generate_streams_the_same_text_as_llm_generate():
    from kvflow import LLM, SamplingParams

    proc = run(["generate", "The capital of France is", "--max-tokens", "12"])
    assert proc.returncode == 0, proc.stderr
    expected = LLM().generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12))
    assert proc.stdout == expected[0].outputs[0].text + "\n"


@pytest.mark.slow
def test_chat_is_multi_turn_and_exits_cleanly():
    proc = run(["chat", "--temperature", "0", "--max-tokens", "16"], stdin="What is 2+2?\n/reset\nSay hi.\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    replies = [line for line in proc.stdout.split("> ") if line.strip()]
    assert len(replies) >= 3  # banner + two answers
    assert all(r.strip() for r in replies[1:])


def test_bad_flag_value_is_a_clear_error(tiny_dir):
    proc = run(["generate", "hi", "--model", tiny_dir, "--block-size", "3"])
    assert proc.returncode == 1
    assert "block_size must be a power of two" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    proc = run(["generate", "hi", "--model", str(tmp_path / "missing")])
    assert proc.returncode == 1 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_throughput_json(tiny_dir):
    proc = run(["bench", "throughput", "--model", tiny_dir, "--skip-tokenizer-init", "--num-prompts", "6",
                "--min-input-len", "4", "--max-input-len", "30", "--output-len", "5", "--json"])
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["num_prompts"] == 6 and r["output_tokens"] == 30
    assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["elapsed_s"])
    assert r["total_tok_s"] == pytest.approx((r["prompt_tokens"] + 30) / r["elapsed_s"])


def test_bench_latency_json(tiny_dir):
    proc = run(["bench", "latency", "--model", tiny_dir, "--skip-tokenizer-init", "--input-len", "8",
                "--output-len", "6", "--num-iters", "2", "--json"])
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"ttft_ms", "decode_tok_s", "itl_ms_p50", "itl_ms_p99"} <= r.keys()
    assert r["ttft_ms"] > 0 and r["decode_tok_s"] > 0 and r["itl_ms_p50"] <= r["itl_ms_p99"]


def test_serve_defaults_to_latency_first_settings_offline_runs_do_not_take():
    """`kvflow serve` defaults to SERVE_MAX_NUM_BATCHED_TOKENS (first tokens of a burst sooner)
    and to populating the KV pool only while idle; generate and the benchmarks keep EngineArgs'
    defaults, and the flags still win."""
    from kvflow.config import EngineArgs
    from kvflow.entrypoints.cli import SERVE_MAX_NUM_BATCHED_TOKENS, build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS
    assert SERVE_MAX_NUM_BATCHED_TOKENS < EngineArgs.max_num_batched_tokens
    assert parser.parse_args(["generate", "hi"]).max_num_batched_tokens == EngineArgs.max_num_batched_tokens
    assert parser.parse_args(["serve", "--max-num-batched-tokens", "4096"]).max_num_batched_tokens == 4096
    assert parser.parse_args(["serve"]).kv_populate == "when-idle"
    assert parser.parse_args(["generate", "hi"]).kv_populate == EngineArgs.kv_populate == "background"
    assert parser.parse_args(["serve", "--kv-populate", "off"]).kv_populate == "off"
    with pytest.raises(ValueError, match="kv_populate"):
        EngineArgs(kv_populate="sometimes").create_config(2048)


def test_serve_fits_only_a_budget_its_user_did_not_give(monkeypatch):
    """Without --max-num-batched-tokens the server is told to fit the budget to the machine; with
    it, even at the default's value, not."""
    from kvflow.entrypoints import cli
    from kvflow.entrypoints.openai import api_server

    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda args: seen.append(args) or 0)
    assert cli.main(["serve"]) == 0 and cli.main(["serve", "--max-num-batched-tokens", "1024"]) == 0
    assert [a.fit_token_budget for a in seen] == [True, False]
    assert [a.max_num_batched_tokens for a in seen] == [cli.SERVE_MAX_NUM_BATCHED_TOKENS, 1024]
