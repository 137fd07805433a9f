"""Run kvflow and its peers on the same workloads, one after another, and print one ratio table.

    .venv/bin/python benchmarks/compare_cpu.py [--llamacpp-python /path/to/python] [--quick]

Peers are optional: one that is not installed is reported as absent, never estimated. Each
engine runs alone (two benchmarks at once on 2 cores spoil both).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kvflow.bench.workloads import random_prompts
from kvflow.model.default_model import default_model_path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 49152  # SmolLM2's; the peers draw the same ids from the same seed


def run_json(cmd: list[str]) -> dict | None:
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    result = json.loads(lines[-1])
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llamacpp-python", default=None, help="an interpreter with llama_cpp installed")
    parser.add_argument("--quick", action="store_true", help="32 prompts instead of 128")
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "compare_cpu.json"))
    args = parser.parse_args()
    n = 32 if args.quick else 128
    py, kv = sys.executable, [sys.executable, "-m", "kvflow.entrypoints.cli", "bench"]
    tput = ["--num-prompts", str(n), "--min-input-len", "32", "--max-input-len", "512", "--output-len", "128"]
    lat = ["--input-len", "32", "--output-len", "128"]
    results: dict[str, dict | None] = {
        "kvflow latency": run_json(kv + ["latency", *lat, "--json"]),
        "hf latency": run_json([py, str(ROOT / "benchmarks/hf_peer.py"), "latency", *lat, "--json"]),
        "kvflow throughput": run_json(kv + ["throughput", *tput, "--json"]),
        "hf throughput": run_json([py, str(ROOT / "benchmarks/hf_peer.py"), "throughput", *tput, "--json"]),
    }
    if args.llamacpp_python:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(random_prompts(1, 32, 32, VOCAB, 0), f)
        results["llama.cpp latency"] = run_json([args.llamacpp_python, str(ROOT / "benchmarks/llamacpp_peer.py"), "latency",
                                                 "--model", str(default_model_path()), "--prompts", f.name])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(table(results))


def table(r: dict[str, dict | None]) -> str:
    def value(key: str, field: str) -> float | None:
        return None if r.get(key) is None else r[key][field]

    def fmt(x: float | None, unit: str = "") -> str:
        return "absent" if x is None else f"{x:.1f}{unit}"

    def ratio(a: float | None, b: float | None) -> str:
        return "—" if a is None or b is None else f"{a / b:.2f}×"

    ours_tp, hf_tp = value("kvflow throughput", "output_tok_s"), value("hf throughput", "output_tok_s")
    ours_dec, hf_dec = value("kvflow latency", "decode_tok_s"), value("hf latency", "decode_tok_s")
    lc_dec = value("llama.cpp latency", "decode_tok_s")
    rows = [
        "| workload | kvflow | HF generate() | kvflow / HF | llama.cpp | kvflow / llama.cpp |",
        "|---|---|---|---|---|---|",
        f"| throughput, output tok/s | {fmt(ours_tp)} | {fmt(hf_tp)} | {ratio(ours_tp, hf_tp)} | — | — |",
        f"| throughput, total tok/s | {fmt(value('kvflow throughput', 'total_tok_s'))} | "
        f"{fmt(value('hf throughput', 'total_tok_s'))} | "
        f"{ratio(value('kvflow throughput', 'total_tok_s'), value('hf throughput', 'total_tok_s'))} | — | — |",
        f"| batch-1 decode tok/s | {fmt(ours_dec)} | {fmt(hf_dec)} | {ratio(ours_dec, hf_dec)} | {fmt(lc_dec)} | {ratio(ours_dec, lc_dec)} |",
        f"| batch-1 TTFT ms (32 tokens) | {fmt(value('kvflow latency', 'ttft_ms'))} | {fmt(value('hf latency', 'ttft_ms'))} | "
        f"{ratio(value('hf latency', 'ttft_ms'), value('kvflow latency', 'ttft_ms'))} (HF / kvflow) | "
        f"{fmt(value('llama.cpp latency', 'ttft_ms'))} | — |",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
