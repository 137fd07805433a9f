"""Run kvflow and its peers on the same workloads, one after another, and print one ratio table.

    .venv/bin/python benchmarks/compare_cpu.py [--llamacpp-python /work/peers/bin/python]
                                               [--llamacpp-bin-dir /work/peers/llamacpp/bin]
                                               [--openvino-python /work/peers/openvino-venv/bin/python]
                                               [--vllm-python /work/vllm-venv/bin/python] [--quick]

W1 = `kvflow bench throughput` defaults (128 prompts of 32..512 random tokens, 128 out), W2 =
`kvflow bench latency` defaults (32 in, 128 out, batch 1); every engine gets the same token ids
(kvflow.bench.workloads, seed 0). Peers: HF transformers generate() (static batches of 16),
llama.cpp through llama-cpp-python on the same GGUF (W2 only: its Python API has no batching
across requests), llama.cpp's own `llama-bench` built natively (W2 only: the decode rate of its
`-n 128` test; it times no first token), OpenVINO GenAI's continuous-batching pipeline on the
default model exported to OpenVINO IR (benchmarks/peers/setup_peers.sh builds both native peers),
vLLM's CPU build on the float32 HF directory of the same weights. Peers are optional: one without
an interpreter or binary, or whose run fails, is reported as absent, never estimated. Each engine
runs alone (two benchmarks at once on 2 cores spoil both).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_oracle import default_model_hf_dir, gemma3_270m_hf_dir  # noqa: E402

from kvflow.bench.ceilings import measure_ceilings  # noqa: E402
from kvflow.bench.datasets import DEFAULT_VOCAB_SIZE
from kvflow.bench.workloads import random_prompts  # noqa: E402
from kvflow.model.default_model import default_model_path  # noqa: E402
from kvflow.model.packaged_models import gemma3_270m_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEERS = (("hf", "HF generate()"), ("llama.cpp", "llama.cpp"), ("llama-bench", "llama-bench (native)"),
         ("openvino", "OpenVINO GenAI"), ("vllm", "vLLM"))
# setup_peers.sh exports the default model only: the OpenVINO peer sits out any other model.
OPENVINO_MODEL = Path("/work/peers/smollm2-ov")
# (label, workload, field, higher is better)
ROWS = (
    ("W1 throughput, output tok/s", "throughput", "output_tok_s", True),
    ("W1 throughput, total tok/s", "throughput", "total_tok_s", True),
    ("W2 batch-1 decode tok/s", "latency", "decode_tok_s", True),
    ("W2 batch-1 TTFT ms (32 tokens)", "latency", "ttft_ms", False),
)


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


def write_json(directory: Path, name: str, data: object) -> str:
    path = directory / name
    path.write_text(json.dumps(data))
    return str(path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llamacpp-python", default=None, help="an interpreter with llama_cpp installed")
    parser.add_argument("--llamacpp-bin-dir", default=None, help="a directory with llama.cpp's native llama-bench")
    parser.add_argument("--openvino-python", default=None, help="an interpreter with openvino_genai installed")
    parser.add_argument("--openvino-model", default=str(OPENVINO_MODEL), help="the default model as OpenVINO IR")
    parser.add_argument("--vllm-python", default=None, help="an interpreter with vllm (CPU build) installed")
    parser.add_argument("--quick", action="store_true", help="32 prompts instead of 128")
    parser.add_argument("--model", default="default", choices=["default", "gemma3-270m"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"],
                        help="W1's KV cache: kvflow's, with vLLM on fp8 (its CPU backend's one-byte KV) and "
                             "OpenVINO on u8 for either one-byte choice; HF has none and runs bf16 KV")
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "compare_cpu.json"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    n = 32 if args.quick else 128
    gemma = args.model == "gemma3-270m"
    gguf = gemma3_270m_path() if gemma else default_model_path()
    hf_dir = gemma3_270m_hf_dir() if gemma else default_model_hf_dir()
    py, kv = sys.executable, [sys.executable, "-m", "kvflow.entrypoints.cli", "bench"]
    tput = ["--num-prompts", str(n), "--min-input-len", "32", "--max-input-len", "512", "--output-len", "128"]
    one_byte_kv = args.kv_cache_dtype != "auto"
    kv_tput = ["--kv-cache-dtype", args.kv_cache_dtype] if one_byte_kv else []
    lat = ["--input-len", "32", "--output-len", "128"]
    on_model = ["--model", args.model] if gemma else []  # the same model for kvflow and the HF peer
    tmp = Path(tempfile.mkdtemp(prefix="kvflow-compare-"))
    # Measure the ceilings once, so both kvflow runs state MBU / MFU against the same numbers.
    ceilings = measure_ceilings().to_json()
    ceil_args = ["--ceilings-json", write_json(tmp, "ceilings.json", ceilings)]
    results: dict[str, dict | None] = {
        "ceilings": ceilings,
        "kvflow latency": run_json(kv + ["latency", *lat, *on_model, *ceil_args, "--json"]),
        "hf latency": run_json([py, str(ROOT / "benchmarks/hf_peer.py"), "latency", *lat, *on_model, "--json"]),
        "kvflow throughput": run_json(kv + ["throughput", *tput, *kv_tput, *on_model, *ceil_args, "--json"]),
        "hf throughput": run_json([py, str(ROOT / "benchmarks/hf_peer.py"), "throughput", *tput, *on_model, "--json"]),
    }
    w1 = write_json(tmp, "w1.json", random_prompts(n, 32, 512, DEFAULT_VOCAB_SIZE, 0))
    w2 = write_json(tmp, "w2.json", random_prompts(1, 32, 32, DEFAULT_VOCAB_SIZE, 0))
    results |= llamacpp_results(args, gguf, w2)
    results |= openvino_results(args, None if gemma else Path(args.openvino_model), w1, w2, one_byte_kv)
    results |= vllm_results(args, hf_dir, w1, w2, one_byte_kv)
    results["w1 kv_cache_dtype"] = {"kvflow": args.kv_cache_dtype, "vllm": "fp8" if one_byte_kv else "auto",
                                    "openvino": "u8" if one_byte_kv else "bf16", "hf": "auto"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(table(results))


def llamacpp_results(args: argparse.Namespace, gguf: Path, w2: str) -> dict[str, dict | None]:
    """W2 from llama.cpp twice: through its Python binding, and its own llama-bench. A peer without
    an interpreter or binary is recorded as absent (None), not left out of the table."""
    results: dict[str, dict | None] = {"llama.cpp latency": None, "llama-bench latency": None}
    if args.llamacpp_python:
        results["llama.cpp latency"] = run_json([args.llamacpp_python, str(ROOT / "benchmarks/llamacpp_peer.py"),
                                                 "latency", "--model", str(gguf), "--prompts", w2])
    if args.llamacpp_bin_dir and (Path(args.llamacpp_bin_dir) / "llama-bench").is_file():
        results["llama-bench latency"] = run_json([sys.executable, str(ROOT / "benchmarks/llamacpp_native_peer.py"),
                                                   "latency", "--bin-dir", args.llamacpp_bin_dir, "--model", str(gguf),
                                                   "--input-len", "32", "--output-len", "128"])
    return results


def openvino_results(args: argparse.Namespace, model: Path | None, w1: str, w2: str,
                     one_byte_kv: bool) -> dict[str, dict | None]:
    """W1 and W2 from OpenVINO GenAI; absent (None) without its interpreter or the exported model."""
    results: dict[str, dict | None] = {"openvino throughput": None, "openvino latency": None}
    if not args.openvino_python or model is None or not model.is_dir():
        return results
    openvino = [args.openvino_python, str(ROOT / "benchmarks/openvino_peer.py")]
    on_model = ["--model", str(model), "--output-len", "128"]
    results["openvino throughput"] = run_json([*openvino, "throughput", *on_model, "--prompts", w1,
                                               "--kv-cache-precision", "u8" if one_byte_kv else "bf16"])
    results["openvino latency"] = run_json([*openvino, "latency", *on_model, "--prompts", w2])
    return results


def vllm_results(args: argparse.Namespace, hf_dir: Path, w1: str, w2: str, one_byte_kv: bool) -> dict[str, dict | None]:
    """W1 and W2 from vLLM's CPU build; absent (None) without its interpreter."""
    results: dict[str, dict | None] = {"vllm throughput": None, "vllm latency": None}
    if args.vllm_python:
        vllm = [args.vllm_python, str(ROOT / "benchmarks/vllm_peer.py")]
        model = ["--model", str(hf_dir)]
        results["vllm throughput"] = run_json([*vllm, "throughput", *model, "--prompts", w1, "--output-len", "128",
                                               *(["--kv-cache-dtype", "fp8"] if one_byte_kv else [])])
        results["vllm latency"] = run_json([*vllm, "latency", *model, "--prompts", w2, "--output-len", "128"])
    return results


def table(r: dict[str, dict | None]) -> str:
    """Markdown: each engine's figure, and kvflow's speed relative to each peer (> 1 = kvflow
    faster; for TTFT that is peer TTFT / kvflow TTFT)."""

    def value(engine: str, workload: str, field: str) -> float | None:
        found = r.get(f"{engine} {workload}")
        return None if found is None else found.get(field)

    def cell(engine: str, workload: str, field: str) -> str:
        if f"{engine} {workload}" not in r:
            return "not run"  # e.g. llama.cpp W1: its Python API cannot batch requests
        found = r[f"{engine} {workload}"]
        if found is not None and field not in found:
            return "not measured"  # e.g. llama-bench's TTFT: it times forward passes only
        return fmt(value(engine, workload, field))

    def ratio(ours: float | None, theirs: float | None, higher_is_better: bool) -> str:
        if ours is None or theirs is None:
            return "—"
        return f"{(ours / theirs if higher_is_better else theirs / ours):.2f}×"

    def fmt(x: float | None) -> str:
        return "absent" if x is None else f"{x:.1f}"

    header = ["workload", "kvflow", *(f"{name} | kvflow vs {name}" for _, name in PEERS)]
    lines = ["| " + " | ".join(header) + " |", "|---" * (2 + 2 * len(PEERS)) + "|"]
    for label, workload, field, higher in ROWS:
        ours = value("kvflow", workload, field)
        cells = [label, fmt(ours)]
        for key, _ in PEERS:
            theirs = value(key, workload, field)
            cells += [cell(key, workload, field), ratio(ours, theirs, higher)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    kv_dtypes = r.get("w1 kv_cache_dtype") or {}
    if kv_dtypes.get("kvflow", "auto") != "auto":
        lines.append(f"W1 KV cache: kvflow {kv_dtypes['kvflow']}, vLLM {kv_dtypes['vllm']}, "
                     f"OpenVINO {kv_dtypes.get('openvino', 'bf16')}, HF bf16")
    for workload in ("throughput", "latency"):
        mbu, mfu = value("kvflow", workload, "mbu"), value("kvflow", workload, "mfu")
        if mbu is not None and mfu is not None:
            lines.append(f"kvflow {workload}: MBU {100 * mbu:.3g}%, MFU {100 * mfu:.3g}%")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
