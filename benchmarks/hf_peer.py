"""HF transformers generate() on kvflow's benchmark workloads (the peer for docs/performance-journal.md).

    python benchmarks/hf_peer.py throughput --batch-size 16 --json
    python benchmarks/hf_peer.py latency --json

Same token ids as `kvflow bench` (kvflow.bench.workloads, same seed), same weights (transformers'
own float32 load of the default GGUF, cast to --dtype), greedy, exactly --output-len new tokens.
Throughput runs static batches in arrival order, left-padded, as a user of generate() would.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_oracle import default_model_hf_dir, gemma3_270m_hf_dir  # noqa: E402

from kvflow.bench.workloads import random_prompts  # noqa: E402

HF_DIRS = {"default": default_model_hf_dir, "gemma3-270m": gemma3_270m_hf_dir}


def load(dtype: str, model: str = "default"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(HF_DIRS[model](), dtype=getattr(torch, dtype)).eval()


def generate(model, batch: list[list[int]], new_tokens: int, pad_id: int) -> int:
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id)
    return (out.shape[1] - width) * len(batch)


def throughput(args) -> dict:
    model = load(args.dtype, args.model)
    prompts = random_prompts(args.num_prompts, args.min_input_len, args.max_input_len, model.config.vocab_size, args.seed)
    generate(model, prompts[:2], 4, 0)  # warm-up
    start = time.perf_counter()
    output_tokens = sum(generate(model, prompts[i:i + args.batch_size], args.output_len, 0)
                        for i in range(0, len(prompts), args.batch_size))
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    return {"engine": f"transformers generate() static batch {args.batch_size}", "num_prompts": len(prompts),
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "elapsed_s": elapsed,
            "output_tok_s": output_tokens / elapsed, "total_tok_s": (prompt_tokens + output_tokens) / elapsed}


def latency(args) -> dict:
    model = load(args.dtype, args.model)
    prompt = random_prompts(1, args.input_len, args.input_len, model.config.vocab_size, args.seed)[0]
    generate(model, [prompt], 8, 0)  # warm-up

    def timed(n: int) -> float:
        start = time.perf_counter()
        generate(model, [prompt], n, 0)
        return time.perf_counter() - start

    ttft = statistics.median(timed(1) for _ in range(args.num_iters))
    full = statistics.median(timed(args.output_len) for _ in range(args.num_iters))
    return {"engine": "transformers generate()", "ttft_ms": ttft * 1e3, "decode_tok_s": (args.output_len - 1) / (full - ttft)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=["throughput", "latency"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default="default", choices=sorted(HF_DIRS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = throughput(args) if args.workload == "throughput" else latency(args)
    print(json.dumps(result) if args.json else result)


if __name__ == "__main__":
    main()
