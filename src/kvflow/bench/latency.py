"""`kvflow bench latency`: one request at a time; time to first token and the decode rate."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

from kvflow.bench.ceilings import Ceilings
from kvflow.bench.mbu import (
    EngineShape,
    Utilization,
    add_ceilings_argument,
    get_ceilings,
    latency_decode_work,
    utilization,
)
from kvflow.bench.workloads import percentile, random_prompts
from kvflow.config import EngineArgs
from kvflow.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class LatencyWorkload:
    """W2 with its defaults: one request of 32 random prompt tokens and 128 output tokens."""

    input_len: int = 32
    output_len: int = 128
    num_iters: int = 3
    seed: int = 0


def add_latency_parser(subparsers) -> argparse.ArgumentParser:
    d = LatencyWorkload()
    p = subparsers.add_parser("latency", help="batch-1 latency: TTFT and decode tokens/s")
    p.add_argument("--input-len", type=int, default=d.input_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--num-iters", type=int, default=d.num_iters, help="measured runs; the median is reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--prompt-set", default="random", choices=["random", "grounded", "chat"],
                   help="with --speculative-config: random token ids, rewrite/summarize-a-passage, or chat")
    p.add_argument("--num-prompts", type=int, default=4, help="with --speculative-config: requests per iteration")
    add_ceilings_argument(p)
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


def measure_latency(engine, workload: LatencyWorkload, ceilings: Ceilings) -> dict:
    """The median of `num_iters` lone requests; MBU and MFU are the decode phase's."""
    input_len, output_len = workload.input_len, workload.output_len
    prompt = random_prompts(1, input_len, input_len, engine.arch.vocab_size, workload.seed)[0]
    measure_once(engine, prompt, 8)  # warm-up
    runs = [measure_once(engine, prompt, output_len) for _ in range(workload.num_iters)]
    ttft = statistics.median(r[0] for r in runs)
    gaps = [g for _, run_gaps in runs for g in run_gaps]
    decode_s = statistics.median(sum(g) for _, g in runs)
    shape = EngineShape.from_engine(engine)
    work = latency_decode_work(shape.spec, input_len, output_len, shape.dtype_bytes, shape.weight_bytes)
    util = utilization(work, decode_s, ceilings)
    return {
        "input_len": input_len,
        "output_len": output_len,
        "ttft_ms": ttft * 1e3,
        "decode_tok_s": (output_len - 1) / decode_s,
        "itl_ms_p50": percentile(gaps, 50) * 1e3,
        "itl_ms_p99": percentile(gaps, 99) * 1e3,
        "mbu": util.mbu,
        "mfu": util.mfu,
        "dtype": shape.dtype,
        "ceilings": ceilings.to_json(),
    }


def run_latency(args: argparse.Namespace) -> int:
    from kvflow.engine.llm_engine import LLMEngine

    if args.speculative_config:
        from kvflow.bench.spec_latency import run_speculative_latency

        return run_speculative_latency(args)

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    shape = EngineShape.from_engine(engine)
    ceilings = get_ceilings(args.ceilings_json, shape.dtype, shape.device)
    workload = LatencyWorkload(args.input_len, args.output_len, args.num_iters, args.seed)
    result = measure_latency(engine, workload, ceilings)
    print(json.dumps(result) if args.json else
          f"TTFT {result['ttft_ms']:.1f} ms   decode {result['decode_tok_s']:.1f} tok/s   "
          f"ITL p50 {result['itl_ms_p50']:.1f} ms, p99 {result['itl_ms_p99']:.1f} ms   "
          f"decode {Utilization(result['mbu'], result['mfu']).describe()}")
    return 0
