"""Tensor-parallel scaling on this machine: the same workload at TP=1 and TP=2, and where rank 0's
time goes at TP=2 (issue 14).

    python benchmarks/tp_scaling.py --config benchmarks/configs/qwen2.5-0.5b/config.json

Dummy weights of the given config (no download; the config must have heads that split over 2 ranks:
SmolLM2-135M's 9 heads do not). For each TP size, in alternating rounds, one engine runs a prefill-
heavy batch and a decode-heavy batch; the report gives output tokens/s and ms per step (medians over
rounds). TP=1 runs twice: on all cores, and on one thread (what each rank gets at TP=2 on 2 cores),
so the split's own cost is seen apart from threading. At TP=2 rank 0's time inside the model's
collectives (all-reduce, all-gather) and in broadcasting step messages is timed by wrapping those
calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvflow import LLM, SamplingParams
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.executor import multiprocess


class Clock:
    """Seconds spent inside wrapped functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)


def workload(llm: LLM, prompts: int, input_len: int, output_len: int) -> tuple[float, int, int]:
    """Seconds, output tokens, prompt tokens of one batch."""
    ids = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(input_len)]} for i in range(prompts)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(ids, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return seconds, tokens, prompts * input_len


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="an HF config.json (its directory is the model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=256, help="prompt length of the prefill case")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated in the decode case")
    args = p.parse_args()
    model = str(Path(args.config).parent)
    clock = Clock()
    clock.wrap(TensorParallel, "all_reduce", "all_reduce")
    clock.wrap(TensorParallel, "all_gather", "all_gather")
    clock.wrap(multiprocess, "broadcast_object", "step message broadcast")
    # Prefix caching off: every round recomputes its prompts.
    made = {tp: LLM(model, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype, tensor_parallel_size=tp,
                    kv_cache_memory_gb=0.5, max_num_seqs=16, disable_log_stats=True, enable_prefix_caching=False)
            for tp in (1, 2)}
    # name → (engine, torch threads in this process): TP=1 on all cores, and on one core (a rank's share at TP=2).
    cores = os.cpu_count() or 1
    engines = {"tp1": (made[1], cores), "tp1_1thread": (made[1], 1), "tp2": (made[2], max(1, cores // 2))}
    n = args.num_prompts
    cases = {f"prefill {n}x{args.input_len} in, 1 out": (n, args.input_len, 1),
             f"decode {n}x16 in, {args.output_len} out": (n, 16, args.output_len)}
    for llm, threads in engines.values():  # warm-up: first-call costs stay out of the medians
        torch.set_num_threads(threads)
        workload(llm, 2, 16, 2)
    results: dict = {name: {c: [] for c in cases} for name in engines}
    comm: dict = {c: [] for c in cases}
    for _ in range(args.rounds):
        for case, shape in cases.items():
            for name, (llm, threads) in engines.items():
                clock.seconds.clear()
                torch.set_num_threads(threads)  # per process: rank 1 has its own
                seconds, _, _ = workload(llm, *shape)
                results[name][case].append(seconds)
                print(f"{name} {case}: {seconds:.2f} s", file=sys.stderr, flush=True)
                if name == "tp2":
                    comm[case].append({k: v / seconds for k, v in clock.seconds.items()})
    report = {}
    for case, (n, input_len, output_len) in cases.items():
        row = {}
        for name in engines:
            s = statistics.median(results[name][case])
            row[f"{name}_seconds"] = round(s, 3)
            row[f"{name}_tokens_per_s"] = round(n * (input_len + output_len) / s, 1)
        row["tp2_speedup_over_tp1"] = round(row["tp1_seconds"] / row["tp2_seconds"], 3)
        row["tp2_rank0_share"] = {k: round(statistics.median(d[k] for d in comm[case]), 3) for k in comm[case][0]}
        report[case] = row
    print(json.dumps(report, indent=2))
    for llm in made.values():
        llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
