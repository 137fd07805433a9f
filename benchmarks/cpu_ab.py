"""An interleaved A/B of one CPU lever on W1 and W2, both engines in one process.

    PYTHONPATH=src .venv/bin/python benchmarks/cpu_ab.py --lever fused-ops [--rounds 3] [--quick]
        [--model gemma3-270m]

A lever is an engine argument; B is the engine built with it turned the other way:
`fused-ops` (RMSNorm, RoPE and SiLU·up as one C++ kernel each, model/layers/cpu_ops; B: their torch
code, `custom_ops="none"`); `decode-loop` (decode steps as one C++ call or flat loop of kernel calls,
worker/cpu_decode.py; B: through the modules, `enforce_eager=True`); `weight-layouts` (quantized
weights' bf16 layouts for products of many rows, quant/int4pack.py; B: their codes alone,
`cpu_weight_layouts="compact"`). The kernels that used to be levers here (attention in place,
the C++ KV write, the int4 GEMV and its int8 levels, the C++ decode step over its Python loop)
won their A/Bs (docs/performance-journal.md) and are no longer switched; their tests and benchmarks call
them with explicit arguments. The KV pool's populate is `--kv-populate`: after B's first round its
pages are mapped too, so compare it in separate processes (docs/performance-journal.md).
Engine A (lever on) and engine B (off) are built once, then each round runs W1 (`kvflow bench
throughput`'s workload; --quick: 32 prompts) and W2 (`kvflow bench latency`'s) on A, then on B: on
a shared machine the load drifts, and alternating spreads it over both. The medians of the rounds
and their ratio are printed with the load average; numbers for docs/performance-journal.md's peer table
come from compare_cpu.py on a quiet machine, not from here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from kvflow.bench.ceilings import Ceilings
from kvflow.bench.latency import LatencyWorkload, measure_latency
from kvflow.bench.throughput import ThroughputWorkload, measure_throughput
from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine

# lever → the engine argument that turns it off
LEVERS = {"fused-ops": {"custom_ops": "none"}, "decode-loop": {"enforce_eager": True},
          "weight-layouts": {"cpu_weight_layouts": "compact"}}


def build(off: dict, model: str | None) -> LLMEngine:
    return LLMEngine(EngineArgs(kv_cache_memory_gb=1.0, **({"model": model} if model else {}), **off))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lever", choices=sorted(LEVERS), default="fused-ops")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="W1 with 32 prompts instead of 128")
    parser.add_argument("--model", help="as `kvflow --model` (default: the default model)")
    args = parser.parse_args()
    engines = {"on": build({}, args.model), "off": build(LEVERS[args.lever], args.model)}
    ceilings = Ceilings(memory_bandwidth_gb_s=1.0, peak_flops=1e12, dtype="bfloat16", device="cpu")  # ratios only
    results = {name: {"w1": [], "w2": []} for name in engines}
    loads = []
    for round_ in range(args.rounds):
        # New prompts each round: the same ones again would hit the prefix cache and skip prefill.
        w1 = ThroughputWorkload(num_prompts=32 if args.quick else 128, seed=round_)
        for name, engine in engines.items():
            loads.append(os.getloadavg()[0])
            results[name]["w1"].append(measure_throughput(engine, w1, ceilings)["output_tok_s"])
            results[name]["w2"].append(measure_latency(engine, LatencyWorkload(), ceilings)["decode_tok_s"])
            print(f"lever {name}: W1 {results[name]['w1'][-1]:.1f} output tok/s, W2 {results[name]['w2'][-1]:.1f} "
                  f"decode tok/s (load {loads[-1]:.1f})", flush=True)  # a run cut short still reports
    summary = {name: {w: statistics.median(v) for w, v in r.items()} for name, r in results.items()}
    print(f"lever {args.lever}: {args.rounds} interleaved rounds, W1 {w1.num_prompts} prompts, "
          f"load average {min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} CPUs")
    print("| | lever on | lever off | on / off |")
    print("|---|---|---|---|")
    for w, label in (("w1", "W1 output tok/s"), ("w2", "W2 batch-1 decode tok/s")):
        on, off = summary["on"][w], summary["off"][w]
        print(f"| {label} | {on:.1f} | {off:.1f} | {on / off:.2f}× |")
    print(json.dumps({"lever": args.lever, "rounds": results, "load": loads}))


if __name__ == "__main__":
    main()
