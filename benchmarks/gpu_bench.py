"""Issue 6 on a GPU: kvflow against HF transformers on a dummy-weight Llama-3.1-8B, in one run.

    python benchmarks/gpu_bench.py --out bench-results/gpu                 # the 8B run on a GPU
    python benchmarks/gpu_bench.py --out /tmp/gb --device cpu --model DIR   # any config, on CPU

Three phases, each in its own process so no two engines share GPU memory (or a CUDA context):
1. ceilings: the GPU's copy bandwidth and bf16 matmul peak (`kvflow bench ceilings`' code);
2. kvflow: batch-1 decode (`kvflow bench latency`'s measurement, with MBU against 1.), then
   offline throughput: all requests submitted at once (continuous batching);
3. HF transformers: the same two workloads with `generate()`, a static KV cache and its decode
   step compiled (generate() compiles it itself when the cache is static, on a GPU), throughput
   in static batches (left-padded) in arrival order.

Throughput workload: --num-requests prompts of random token ids, prompt and output lengths each
uniform in [--min-len, --max-len] (seeded), EOS ignored so every request makes exactly its own
output length. For HF a batch generates until its longest request is done; only each request's
own output tokens count as useful.

Every phase runs under a time limit derived from --budget-s, so the whole run ends in time even
if a phase hangs; a killed phase keeps what it had written. HF's throughput may stop after fewer
requests (--hf-throughput-cap-s); kvflow's stops early only past --kvflow-throughput-cap-s, and
both outputs then say how many requests ran. Results: <out>/gpu_bench.json, <out>/gpu_bench.md,
and the phases' logs in <out>/gpu_bench.log.

This file is the CLI and the orchestrator; beside it, gpu_kvflow.py runs phases 1 and 2,
gpu_hf.py phase 3, gpu_phase.py holds what the phases share and gpu_report.py writes the results.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
# Measure this checkout's engine, not whichever kvflow happens to be installed; the phases' modules
# sit beside this file, which is not on sys.path when it is loaded by its path (as the tests do).
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

from gpu_hf import phase_hf  # noqa: E402
from gpu_kvflow import phase_ceilings, phase_kvflow  # noqa: E402
from gpu_phase import ResultFile, log  # noqa: E402
from gpu_report import markdown, summarize  # noqa: E402

from kvflow.bench.mbu import load_ceilings  # noqa: E402

DEFAULT_MODEL = HERE / "configs" / "llama-3.1-8b"

PHASES = {"ceilings": phase_ceilings, "kvflow": phase_kvflow, "hf": phase_hf}


def run_phase(name: str, argv: list[str], timeout: float, workdir: Path, log_file: Path,
              ceilings_path: Path | None) -> dict[str, Any]:
    """One phase in a fresh interpreter; its result, with how it ended under "phase"."""
    result_path = workdir / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--phase", name, "--result", str(result_path),
           "--deadline", str(time.time() + timeout)]
    if ceilings_path is not None:
        cmd += ["--ceilings-json", str(ceilings_path)]
    log(f"phase {name}: up to {timeout:.0f} s")
    start = time.perf_counter()
    with log_file.open("a") as logf:
        logf.write(f"\n===== phase {name} =====\n")
        logf.flush()
        try:
            proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout, check=False)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "killed at its time limit"
    wall = time.perf_counter() - start
    log(f"phase {name}: {'ok' if rc == 0 else f'FAILED ({rc}), see {log_file}'} after {wall:.0f} s")
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    return {**result, "phase": {"rc": rc, "wall_s": wall, "time_limit_s": timeout}}


def orchestrate(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_file = out_dir / "gpu_bench.log"
    log_file.write_text("")
    deadline = time.monotonic() + args.budget_s
    workdir = Path(tempfile.mkdtemp(prefix="gpu-bench-"))

    if args.ceilings_json:
        ceilings_result = {"ceilings": load_ceilings(args.ceilings_json).to_json(), "device": {"name": args.device}}
    else:
        ceilings_result = run_phase("ceilings", argv, min(120.0, args.budget_s), workdir, log_file, None)
    if "ceilings" not in ceilings_result:
        raise SystemExit(f"gpu_bench: the ceilings phase failed; see {log_file}")
    ceilings_path = workdir / "ceilings-only.json"
    ceilings_path.write_text(json.dumps(ceilings_result["ceilings"]))

    hf_reserve = 0 if args.skip_hf else args.hf_reserve_s
    kvflow = run_phase("kvflow", argv, max(60.0, deadline - time.monotonic() - hf_reserve), workdir, log_file,
                       ceilings_path)
    hf = None
    if not args.skip_hf:
        hf = run_phase("hf", argv, max(60.0, deadline - time.monotonic() - 5), workdir, log_file, ceilings_path)

    report = summarize(args, ceilings_result, kvflow, hf)
    (out_dir / "gpu_bench.json").write_text(json.dumps(report, indent=2))
    (out_dir / "gpu_bench.md").write_text(markdown(report))
    return report


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for gpu_bench.json, gpu_bench.md, gpu_bench.log")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="directory with a config.json (weights are random)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=540, help="the whole run's time; phases are killed past it")
    w = p.add_argument_group("workloads")
    w.add_argument("--num-requests", type=int, default=512)
    w.add_argument("--min-len", type=int, default=100, help="shortest prompt and shortest output")
    w.add_argument("--max-len", type=int, default=1024, help="longest prompt and longest output")
    w.add_argument("--latency-input-len", type=int, default=32)
    w.add_argument("--latency-output-len", type=int, default=128)
    w.add_argument("--latency-iters", type=int, default=3, help="timed batch-1 runs; the median is reported")
    k = p.add_argument_group("kvflow")
    k.add_argument("--attention-backend", default=None, help="default: triton on CUDA, torch_sdpa on CPU")
    k.add_argument("--max-model-len", type=int, default=None, help="default: the longest prompt + output asked")
    k.add_argument("--kv-cache-memory-gb", type=float, default=30.0)
    k.add_argument("--max-num-seqs", type=int, default=256)
    k.add_argument("--max-num-batched-tokens", type=int, default=8192)
    k.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    k.add_argument("--kvflow-throughput-cap-s", type=float, default=240,
                   help="abort kvflow's unfinished requests past this (reported, never silent)")
    h = p.add_argument_group("HF transformers")
    h.add_argument("--hf-batch-size", type=int, default=64)
    h.add_argument("--hf-throughput-cap-s", type=float, default=120,
                   help="start no HF batch past this; fewer requests are then run (and reported)")
    h.add_argument("--hf-reserve-s", type=float, default=210, help="time of the budget kept for the HF phase")
    h.add_argument("--skip-hf", action="store_true")
    c = p.add_argument_group("ceilings")
    c.add_argument("--ceilings-json", default=None, help="`kvflow bench ceilings --json` output instead of measuring")
    c.add_argument("--copy-mib", type=int, default=128, help="size of the timed copy")
    c.add_argument("--max-matmul-n", type=int, default=None, help="largest square matmul timed")
    # Set by the orchestrator for the process of one phase.
    p.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.phase:
        result = ResultFile(args.result)
        ceilings = load_ceilings(args.ceilings_json) if args.ceilings_json else None
        PHASES[args.phase](args, *([] if args.phase == "ceilings" else [ceilings]), result)
        return 0
    report = orchestrate(args, argv)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
