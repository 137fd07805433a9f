"""llama.cpp's own binaries, built natively by benchmarks/peers/setup_peers.sh, on kvflow's default
GGUF: issue 45's "W2 against native `llama-bench -p 0 -n 128 -t 2`", and a served run.

    .venv/bin/python benchmarks/llamacpp_native_peer.py latency --bin-dir /work/peers/llamacpp/bin
    .venv/bin/python benchmarks/llamacpp_native_peer.py serve --bin-dir /work/peers/llamacpp/bin

latency: one `llama-bench -p 32 -n 128 -t 2 -o json` process. Its tg128 test is the issue's
`-p 0 -n 128` test (llama-bench runs each -n test on its own, whatever -p says), its pp32 test
W2's 32-token prompt. llama-bench times the model's forward passes alone (no tokenizer, no sampler,
no scheduler) and decodes from an empty cache, so its figures are the engine's best case: the
prompt's time is printed as `prompt_ms`, never as a time to first token.

serve: `llama-server` with one slot per client in flight and continuous batching, loaded by
`kvflow bench serve` with docs/performance.md's served workload (64 requests of 256 random token
ids, 64 out, 16 at once); prints that report with the server's command line beside it.

Runs under kvflow's interpreter (the served load is kvflow's own client); the peer is the binaries.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def default_gguf() -> str:
    from kvflow.model.default_model import default_model_path

    return str(default_model_path())


def bench_results(binary: Path, model: str, prompt_len: int, output_len: int, threads: int,
                  repetitions: int) -> list[dict]:
    cmd = [str(binary), "-m", model, "-p", str(prompt_len), "-n", str(output_len), "-t", str(threads),
           "-r", str(repetitions), "-o", "json"]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def find_test(results: list[dict], n_prompt: int, n_gen: int) -> dict:
    for test in results:
        if test["n_prompt"] == n_prompt and test["n_gen"] == n_gen:
            return test
    raise RuntimeError(f"llama-bench printed no test with n_prompt={n_prompt}, n_gen={n_gen}")


def latency(args: argparse.Namespace) -> dict:
    results = bench_results(args.bin_dir / "llama-bench", args.model, args.input_len, args.output_len, args.threads,
                            args.repetitions)
    decode = find_test(results, 0, args.output_len)
    prompt = find_test(results, args.input_len, 0)
    return {"engine": "llama.cpp llama-bench (native)", "build": decode.get("build_commit"),
            "threads": args.threads, "repetitions": args.repetitions,
            "decode_tok_s": decode["avg_ts"], "decode_tok_s_stddev": decode["stddev_ts"],
            "prompt_tok_s": prompt["avg_ts"], "prompt_ms": prompt["avg_ns"] / 1e6,
            "input_len": args.input_len, "output_len": args.output_len}


def server_command(args: argparse.Namespace) -> list[str]:
    # One slot per request in flight, each with room for its prompt and output (plus a BOS the
    # server may add); -c is split evenly between the slots.
    per_slot = args.input_len + args.output_len + 16
    return [str(args.bin_dir / "llama-server"), "-m", args.model, "--host", "127.0.0.1", "--port", str(args.port),
            "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.concurrency), "-cb",
            "-c", str(per_slot * args.concurrency),
            # Random prompts share no prefix: saving idle slots' states to RAM would be pure overhead.
            "--cache-ram", "0", "--no-webui"]


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    # No proxy: a proxy from the environment has no business between a client and a local server.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited {server.returncode} before it was healthy; its log: {log_path}")
        try:
            with opener.open(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server was not healthy at {url} within {timeout_s:.0f} s; its log: {log_path}")


def serve(args: argparse.Namespace) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    command = server_command(args)
    print("$", " ".join(command), f"> {args.server_log}", file=sys.stderr, flush=True)
    # Its log goes to a file: a pipe nobody reads would fill and stall the server mid-run.
    with open(args.server_log, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server, args.startup_timeout, args.server_log)
        load = [sys.executable, "-m", "kvflow.entrypoints.cli", "bench", "serve", "--url", url,
                "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--input-dist", "fixed",
                "--output-len", str(args.output_len), "--concurrency", str(args.concurrency), "--json"]
        print("$", " ".join(load), file=sys.stderr, flush=True)
        done = subprocess.run(load, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"kvflow bench serve exited {done.returncode}: {done.stderr[-2000:]}")
    finally:
        server.terminate()
        server.wait(timeout=30)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {"engine": "llama.cpp llama-server (native)", "server_command": command, **report}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["latency", "serve"])
    parser.add_argument("--bin-dir", type=Path, required=True, help="where llama-bench and llama-server are")
    parser.add_argument("--model", default=None, help="a GGUF file (default: kvflow's default model)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="-t (the issue's: 2, this machine's cores)")
    parser.add_argument("--input-len", type=int, default=None, help="latency: 32 (W2); serve: 256")
    parser.add_argument("--output-len", type=int, default=None, help="latency: 128 (W2); serve: 64")
    parser.add_argument("--repetitions", type=int, default=5, help="latency: llama-bench -r")
    parser.add_argument("--num-prompts", type=int, default=64, help="serve: requests")
    parser.add_argument("--concurrency", type=int, default=16, help="serve: requests in flight, and server slots")
    parser.add_argument("--port", type=int, default=8190, help="serve: llama-server's loopback port")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="serve: seconds to wait for /health")
    parser.add_argument("--server-log", default=str(Path(tempfile.gettempdir()) / "llama-server-peer.log"),
                        help="serve: where llama-server's log goes")
    args = parser.parse_args()
    served = args.mode == "serve"
    args.input_len = args.input_len or (256 if served else 32)
    args.output_len = args.output_len or (64 if served else 128)
    args.model = args.model or default_gguf()
    return args


def main() -> None:
    args = parse_args()
    result = serve(args) if args.mode == "serve" else latency(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
