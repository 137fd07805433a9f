"""llama.cpp (through llama-cpp-python) on the same GGUF and the same token ids.

Runs under any interpreter that has `llama_cpp` installed (it imports nothing from kvflow, so a
separate virtual environment works); the prompts come from a JSON file written by compare_cpu.py.

    python benchmarks/llamacpp_peer.py latency --model M.gguf --prompts p.json --output-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def load(model_path: str, n_ctx: int):
    from llama_cpp import Llama

    return Llama(model_path=model_path, n_ctx=n_ctx, n_threads=os.cpu_count(), n_batch=512, verbose=False)


def run_one(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(TTFT, total) seconds for exactly `new_tokens` greedy tokens."""
    llm.reset()
    start = time.perf_counter()
    first = None
    for count, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), 1):
        first = first or time.perf_counter()
        if count == new_tokens:
            break
    return first - start, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=["latency"])  # its Python API runs one request at a time
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists (the first is used)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    args = parser.parse_args()
    with open(args.prompts) as f:
        prompt = json.load(f)[0]
    llm = load(args.model, n_ctx=len(prompt) + args.output_len + 8)
    run_one(llm, prompt, 4)  # warm-up
    runs = [run_one(llm, prompt, args.output_len) for _ in range(args.num_iters)]
    ttft = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] - r[0] for r in runs)
    print(json.dumps({"engine": "llama.cpp", "ttft_ms": ttft * 1e3, "decode_tok_s": (args.output_len - 1) / decode}))


if __name__ == "__main__":
    main()
