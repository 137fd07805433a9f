"""OpenVINO GenAI's continuous-batching pipeline (paged attention on CPU) on the same token ids as
`kvflow bench` (W1 and W2).

Runs under the interpreter of the OpenVINO virtual environment that benchmarks/peers/setup_peers.sh
makes (it imports nothing from kvflow); the prompts come from a JSON file that compare_cpu.py writes
with kvflow's seeded workload generator, and the model is the default model's HF directory exported
to OpenVINO IR by the same script.

    /work/peers/openvino-venv/bin/python benchmarks/openvino_peer.py throughput --model /work/peers/smollm2-ov --prompts w1.json
    /work/peers/openvino-venv/bin/python benchmarks/openvino_peer.py latency --model /work/peers/smollm2-ov --prompts w2.json

The engine is `ContinuousBatchingPipeline`, the scheduler LLMPipeline hands its work to when it is
given a SchedulerConfig; it is used directly because it takes token ids without padding and exposes
`step()`, so a request can be timed step by step as `kvflow bench latency` times its own. W1 hands
every prompt to one `generate` call; W2 runs one request at a time and times each step that brings a
token. Greedy, `ignore_eos`, exactly --output-len new tokens. The scheduler's settings and the
compile properties are printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def scheduler_config(args: argparse.Namespace):
    import openvino_genai

    config = openvino_genai.SchedulerConfig()
    config.cache_size = args.cache_size_gb
    config.max_num_batched_tokens = args.max_num_batched_tokens
    config.max_num_seqs = args.max_num_seqs
    config.dynamic_split_fuse = args.dynamic_split_fuse
    # Random prompts share no prefix: kept blocks would only take room (vLLM's run had it off too).
    config.enable_prefix_caching = False
    return config


def compile_properties(args: argparse.Namespace) -> dict:
    import openvino as ov
    import openvino.properties as props
    import openvino.properties.hint as hints

    return {hints.inference_precision: getattr(ov.Type, args.inference_precision),
            hints.kv_cache_precision: getattr(ov.Type, args.kv_cache_precision),
            props.inference_num_threads: args.threads}


def settings(args: argparse.Namespace) -> dict:
    """What the figures were measured with, printed beside them."""
    return {"cache_size_gb": args.cache_size_gb, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs, "dynamic_split_fuse": args.dynamic_split_fuse,
            "enable_prefix_caching": False, "inference_precision": args.inference_precision,
            "kv_cache_precision": args.kv_cache_precision, "inference_num_threads": args.threads}


def load(args: argparse.Namespace):
    import openvino_genai

    return openvino_genai.ContinuousBatchingPipeline(args.model, scheduler_config(args), "CPU",
                                                     compile_properties(args))


def greedy(new_tokens: int):
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = new_tokens
    config.ignore_eos = True
    config.do_sample = False
    return config


def token_tensor(prompt: list[int]):
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.array([prompt], dtype=np.int64))


def generate(pipe, prompts: list[list[int]], new_tokens: int) -> int:
    """Output tokens produced for `prompts`, all submitted together."""
    results = pipe.generate([token_tensor(p) for p in prompts], [greedy(new_tokens)] * len(prompts))
    return sum(len(r.m_generation_ids[0]) for r in results)


def throughput(pipe, prompts: list[list[int]], output_len: int) -> dict:
    generate(pipe, prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    output_tokens = generate(pipe, prompts, output_len)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(map(len, prompts))
    return {"engine": "OpenVINO GenAI ContinuousBatchingPipeline", "num_prompts": len(prompts),
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "elapsed_s": elapsed,
            "output_tok_s": output_tokens / elapsed, "total_tok_s": (prompt_tokens + output_tokens) / elapsed}


def measure_once(pipe, prompt: list[int], output_len: int, request_id: int) -> tuple[float, float]:
    """(TTFT, decode seconds after the first token) of one request, stepped by hand."""
    start = time.perf_counter()
    handle = pipe.add_request(request_id, token_tensor(prompt), greedy(output_len))
    stamps = []
    while pipe.has_non_finished_requests():
        pipe.step()
        if handle.can_read():
            handle.read()
            stamps.append(time.perf_counter())
    return stamps[0] - start, stamps[-1] - stamps[0]


def latency(pipe, prompt: list[int], output_len: int, num_iters: int) -> dict:
    measure_once(pipe, prompt, 8, request_id=0)  # warm-up
    runs = [measure_once(pipe, prompt, output_len, request_id=i) for i in range(1, num_iters + 1)]
    ttft = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    return {"engine": "OpenVINO GenAI ContinuousBatchingPipeline", "ttft_ms": ttft * 1e3,
            "decode_tok_s": (output_len - 1) / decode}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["throughput", "latency"])
    parser.add_argument("--model", required=True, help="an OpenVINO IR directory (setup_peers.sh: /work/peers/smollm2-ov)")
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    # W1 at its longest (128 prompts of 512 + 128 tokens of bf16 KV, 23 KB a token) needs 1.9 GB:
    # 2 GB holds the whole batch at once, the pool vLLM's run had.
    parser.add_argument("--cache-size-gb", type=int, default=2, help="KV cache (SchedulerConfig.cache_size)")
    # kvflow's own step budget and batch, so the schedulers differ in how, not in how much.
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--dynamic-split-fuse", action=argparse.BooleanOptionalAction, default=True,
                        help="mix prompt chunks and decodes in one step (kvflow's chunked prefill does)")
    parser.add_argument("--inference-precision", default="bf16", choices=["bf16", "f16", "f32"],
                        help="activations: kvflow computes in bf16 (so does OpenVINO's CPU plugin here by default)")
    # The CPU plugin's own default is u8; bf16 is what kvflow's `auto` stores, so the engines
    # read the same KV bytes unless compare_cpu.py asks both for one-byte KV.
    parser.add_argument("--kv-cache-precision", default="bf16", choices=["bf16", "f16", "u8"],
                        help="bf16 (kvflow's auto) or u8 (its one-byte KV)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    pipe = load(args)
    if args.workload == "throughput":
        result = throughput(pipe, prompts, args.output_len)
    else:
        result = latency(pipe, prompts[0], args.output_len, args.num_iters)
    print(json.dumps({**result, "settings": settings(args)}), flush=True)


if __name__ == "__main__":
    main()
