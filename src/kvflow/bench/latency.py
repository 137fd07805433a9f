"""`kvflow bench latency`: one request at a time; time to first token and the decode rate."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvflow.bench.workloads import percentile, random_prompts
from kvflow.config import EngineArgs
from kvflow.sampling_params import RequestOutputKind, SamplingParams


def add_latency_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("latency", help="batch-1 latency: TTFT and decode tokens/s")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3, help="measured runs; the median is reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_latency)
    return p


def measure_once(engine, prompt: list[int], output_len: int) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) of one request, in seconds."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    start = time.perf_counter()
    engine.add_request(None, prompt, params)
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def run_latency(args: argparse.Namespace) -> int:
    from kvflow.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    prompt = random_prompts(1, args.input_len, args.input_len, engine.arch.vocab_size, args.seed)[0]
    measure_once(engine, prompt, 8)  # warm-up
    runs = [measure_once(engine, prompt, args.output_len) for _ in range(args.num_iters)]
    ttft = statistics.median(r[0] for r in runs)
    gaps = [g for _, run_gaps in runs for g in run_gaps]
    decode_s = statistics.median(sum(g) for _, g in runs)
    result = {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "ttft_ms": ttft * 1e3,
        "decode_tok_s": (args.output_len - 1) / decode_s,
        "itl_ms_p50": percentile(gaps, 50) * 1e3,
        "itl_ms_p99": percentile(gaps, 99) * 1e3,
        "dtype": str(engine.config.model.dtype).removeprefix("torch."),
    }
    print(json.dumps(result) if args.json else
          f"TTFT {result['ttft_ms']:.1f} ms   decode {result['decode_tok_s']:.1f} tok/s   "
          f"ITL p50 {result['itl_ms_p50']:.1f} ms, p99 {result['itl_ms_p99']:.1f} ms")
    return 0
