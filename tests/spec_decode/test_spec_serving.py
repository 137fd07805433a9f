"""Speculation seen from outside: streams carrying several tokens per step, /metrics, the
`--speculative-config` flag, `kvflow plan --speculative` and `kvflow bench latency`'s report."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from live_server import parse_metrics, start_thread
from tiny_models import make_tiny_model

from kvflow import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from kvflow.bench.spec_latency import measure_speculative_latency
from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.cli import build_parser, main
from kvflow.entrypoints.openai.api_server import build_app
from kvflow.entrypoints.plan_cli import main_plan

K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    make_tiny_model("qwen2-bias", path)
    return str(path)


def _args(model_dir: str, speculative: bool = True) -> EngineArgs:
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": K, "adaptive": False}
    return EngineArgs(model_dir, dtype="float32", skip_tokenizer_init=True, disable_log_stats=True,
                      num_kv_blocks=64, speculative_config=spec if speculative else None)


def _prompt(n: int = 11) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def test_a_stream_carries_the_accepted_tokens_and_metrics_count_them(model_dir):
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    want = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, disable_log_stats=True).generate(
        [_prompt()], params.clone(output_kind=RequestOutputKind.FINAL_ONLY), use_tqdm=False)[0].outputs[0].token_ids
    llm = AsyncLLM(LLMEngine(_args(model_dir)))
    finished = []
    llm.add_finish_listener(finished.append)
    live = start_thread(build_app(llm, "tiny"))
    try:
        async def stream() -> list[list[int]]:
            return [out.outputs[0].token_ids async for out in llm.generate(_prompt(), params, "s")]

        deltas = asyncio.run(asyncio.wait_for(stream(), 120))
        assert [t for delta in deltas for t in delta] == want
        assert max(map(len, deltas)) == K + 1  # a verification brings its accepted run at once
        metrics = parse_metrics(httpx.get(f"{live.url}/metrics", timeout=10).text)
    finally:
        live.stop()
        llm.shutdown()
    # Inter-token gaps: one per token after the first, however many tokens a step brought.
    assert len(finished[0].inter_token_latencies) == len(want) - 1
    drafted = metrics["kvflow:spec_decode_num_draft_tokens_total"]
    assert drafted > 0 and metrics["kvflow:spec_decode_num_accepted_tokens_total"] == drafted
    assert metrics["kvflow:spec_decode_num_drafts_total"] == drafted / K
    assert metrics["kvflow:generation_tokens_total"] == len(want)
    assert "kvflow:spec_decode_num_accepted_tokens_per_pos_total" in metrics


def test_the_cli_flag_reaches_the_engine_config():
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    args = build_parser().parse_args(["serve", "--speculative-config", spec])
    config = EngineArgs.from_cli_args(args).create_config(512).speculative
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 3, 5)


def test_a_bad_cli_config_is_a_clear_error(model_dir, capsys):
    code = main(["generate", "hi", "--model", model_dir, "--speculative-config", '{"method": "ngram"}'])
    assert code == 1 and "num_speculative_tokens" in capsys.readouterr().err


def test_plan_prints_the_seeds_predicted_speedup(capsys):
    assert main_plan(["--speculative", "4", "--acceptance", "0.8", "--draft-cost", "0.11", "--model", "llama-2-70b"]) == 0
    assert "speculative k=4 alpha=0.8 r=0.11: 4.20 tokens/pass, speedup 2.92x" in capsys.readouterr().out


def test_bench_latency_reports_alpha_r_and_the_prediction(model_dir):
    spec, plain = LLMEngine(_args(model_dir)), LLMEngine(_args(model_dir, speculative=False))
    report = measure_speculative_latency(spec, plain, [_prompt(5), _prompt(9)], output_len=13, num_iters=1)
    json.dumps(report)
    assert report["alpha"] == 1.0 and report["mean_k"] == K  # the draft is the target
    assert report["greedy_outputs_identical"] == "2/2"
    assert report["r"] > 0 and report["speedup"] > 0
    assert report["predicted_speedup"] == pytest.approx((K + 1) / (1 + K * report["r"]))
