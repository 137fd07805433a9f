"""An interleaved A/B of one CPU lever on W1 and W2, both engines in one process.

    PYTHONPATH=src .venv/bin/python benchmarks/cpu_ab.py --lever attention-kernel [--rounds 3] [--quick]
        [--model gemma3-270m]

Levers: `attention-kernel` (decode attention in place, attention/cpu_paged.py; B: the torch
gather + matmul path, KVFLOW_CPU_ATTENTION_KERNEL=0); `int4-dense` (int4 layers' dense bf16 copy
for calls of more than a few rows, quant/int4pack.py; B: the int4 kernel up to 64 rows, per-call
dequantization above, KVFLOW_INT4_DENSE=0); `fused-ops` (RMSNorm, RoPE and SiLU·up as one C++
kernel each, model/layers/cpu_ops; B: the torch ops, KVFLOW_CPU_FUSED_OPS=0); `kv-write` (the
KV write as one C++ copy, attention/cpu_kv_write.py; B: index_put, KVFLOW_CPU_KV_WRITE=0);
`decode-loop` (decode steps as one loop of kernel calls, worker/cpu_decode.py; B: through the
modules); `decode-step` (that loop as one C++ call where every projection has the GEMV form; B:
the Python loop, KVFLOW_CPU_DECODE_STEP=0); `int4-gemv` (kvflow's few-row int4 GEMV,
quant/int4_gemv.py; B: aten's int4 kernel); `int8-levels` (the GEMV's one-row path with the
activations as two int8 levels; B: bfloat16 products, KVFLOW_INT4_GEMV_INT8_LEVELS=0).
The KV pool's background populate (KVFLOW_KV_POPULATE=0) is no lever here: after B's first round
its pages are mapped too; compare it in separate processes (docs/performance.md).
Engine A (lever on) and engine B (off) are built once, each under its environment (which also holds while it runs:
some levers read it at every call), then each round runs W1 (`kvflow bench throughput`'s
workload; --quick: 32 prompts) and W2 (`kvflow bench latency`'s) on A, then on B: on a shared
machine the load drifts, and alternating spreads it over both. The medians of the rounds and
their ratio are printed with the load average; numbers for docs/performance.md's peer table
come from compare_cpu.py on a quiet machine, not from here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

from kvflow.attention import cpu_kv_write, cpu_paged
from kvflow.bench.ceilings import Ceilings
from kvflow.bench.latency import LatencyWorkload, measure_latency
from kvflow.bench.throughput import ThroughputWorkload, measure_throughput
from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.model.layers import cpu_ops
from kvflow.quant import int4_gemv, int4pack
from kvflow.worker import cpu_decode

LEVERS = {"attention-kernel": {cpu_paged.DISABLE_ENV: "0"}, "int4-dense": {int4pack.DENSE_COPY_ENV: "0"},
          "fused-ops": {cpu_ops.DISABLE_ENV: "0"}, "kv-write": {cpu_kv_write.DISABLE_ENV: "0"},
          "decode-loop": {cpu_decode.DISABLE_ENV: "0"}, "decode-step": {cpu_decode.NATIVE_DISABLE_ENV: "0"},
          "int4-gemv": {int4_gemv.DISABLE_ENV: "0"}, "int8-levels": {int4_gemv.INT8_LEVELS_ENV: "0"}}  # lever → its off switch


def build(off_env: dict[str, str], model: str | None) -> LLMEngine:
    with environment(off_env):
        return LLMEngine(EngineArgs(kv_cache_memory_gb=1.0, **({"model": model} if model else {})))


@contextlib.contextmanager
def environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lever", choices=sorted(LEVERS), default="attention-kernel")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="W1 with 32 prompts instead of 128")
    parser.add_argument("--model", help="as `kvflow --model` (default: the default model)")
    args = parser.parse_args()
    envs = {"on": {}, "off": LEVERS[args.lever]}
    engines = {name: build(env, args.model) for name, env in envs.items()}
    ceilings = Ceilings(memory_bandwidth_gb_s=1.0, peak_flops=1e12, dtype="bfloat16", device="cpu")  # ratios only
    results = {name: {"w1": [], "w2": []} for name in engines}
    loads = []
    for round_ in range(args.rounds):
        # New prompts each round: the same ones again would hit the prefix cache and skip prefill.
        w1 = ThroughputWorkload(num_prompts=32 if args.quick else 128, seed=round_)
        for name, engine in engines.items():
            loads.append(os.getloadavg()[0])
            with environment(envs[name]):
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
