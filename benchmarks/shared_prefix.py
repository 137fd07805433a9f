"""Prefix caching on a shared-prefix workload: TTFT and throughput with caching on vs off.

    .venv/bin/python benchmarks/shared_prefix.py [--num-requests 64 --prefix-len 1024 --question-len 32 --output-len 64]

Every request shares one system prompt and adds its own question; all are submitted at once, so
TTFT includes queueing, as it would for a burst of agent calls. Both settings run in one process,
one after the other, on the same token ids.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from kvflow import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from kvflow.bench.datasets import DEFAULT_VOCAB_SIZE
from kvflow.bench.workloads import percentile, random_token_ids


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = random_token_ids(rng, args.prefix_len, DEFAULT_VOCAB_SIZE)
    return [system + random_token_ids(rng, args.question_len, DEFAULT_VOCAB_SIZE) for _ in range(args.num_requests)]


def run(prompts: list[list[int]], output_len: int, caching: bool) -> dict:
    engine = LLMEngine(EngineArgs(enable_prefix_caching=caching, disable_log_stats=True))
    warm = SamplingParams(temperature=0, max_tokens=2)
    engine.add_request("warm", [5000] * 8, warm)
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    start = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, arrival_time=start)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    elapsed = time.monotonic() - start
    ttfts = [o.metrics.time_to_first_token * 1e3 for o in outputs]
    stats = engine.get_stats()
    return {
        "prefix_caching": caching,
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
        "elapsed_s": elapsed,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
        "prefix_cache_hit_rate": stats.prefix_cache_hits_total / max(1, stats.prefix_cache_queries_total),
        "outputs": {o.request_id: o.outputs[0].token_ids for o in outputs},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = workload(args)
    on, off = run(prompts, args.output_len, True), run(prompts, args.output_len, False)
    same = on.pop("outputs") == off.pop("outputs")
    print(json.dumps({"on": on, "off": off, "identical_outputs": same,
                      "ttft_p50_ratio_on_over_off": on["ttft_ms_p50"] / off["ttft_ms_p50"]}, indent=2))


if __name__ == "__main__":
    main()
