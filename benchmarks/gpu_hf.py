"""gpu_bench's phase 3: HF transformers on the same two workloads, with `generate()`.

A static KV cache and the decode step compiled (generate() compiles it itself when the cache is
static, on a GPU); throughput in static batches (left-padded) in arrival order, each batch
generating until its longest request is done, and only each request's own output tokens count.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from gpu_phase import ResultFile, arch_of, gpu_memory, latency_prompt, log, seconds_left, sync, throughput_workload

from kvflow.analysis.model_spec import ModelSpec
from kvflow.bench.ceilings import Ceilings
from kvflow.bench.mbu import latency_decode_work, utilization


class HFRunner:
    """`generate()` with one static KV cache per batch size, sized for the longest request, so
    every call of a size reuses the same cache tensors and the same compiled decode step."""

    def __init__(self, model: Any, max_cache_len: int, device: str) -> None:
        self.model, self.max_cache_len, self.device = model, max_cache_len, device
        self.caches: dict[int, Any] = {}
        self.compile_config = hf_compile_config(device)

    def generate(self, batch: list[list[int]], new_tokens: int) -> None:
        from transformers import StaticCache

        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
        cache = self.caches.get(len(batch))
        if cache is None:
            cache = self.caches[len(batch)] = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        extra = {"compile_config": self.compile_config} if self.compile_config else {}
        with torch.inference_mode():  # the cache's tensors are inference tensors: reset them inside too
            cache.reset()
            self.model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, **extra)

    def timed(self, batch: list[list[int]], new_tokens: int) -> float:
        sync(self.device)
        start = time.perf_counter()
        self.generate(batch, new_tokens)
        sync(self.device)
        return time.perf_counter() - start


def hf_compile_config(device: str) -> Any:
    """generate() compiles the decode step (never the prefill, whose shape changes) when the cache
    is static, on a GPU only; dynamic=False specialises each batch size, its fastest code."""
    from transformers import CompileConfig

    return CompileConfig(dynamic=False) if device.startswith("cuda") else None


def phase_hf(args: argparse.Namespace, ceilings: Ceilings, out: ResultFile) -> None:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    compile_config = hf_compile_config(args.device)
    start = time.perf_counter()
    config = AutoConfig.from_pretrained(args.model)
    with torch.device(args.device):  # random init straight on the GPU: no 16 GB host copy
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    sync(args.device)
    out.put("engine", {"transformers": transformers.__version__, "init_s": time.perf_counter() - start,
                       "attn_implementation": getattr(model.config, "_attn_implementation", None),
                       "decode_compile_config": compile_config.to_dict() if compile_config else None})
    log(f"HF model ready in {out.data['engine']['init_s']:.1f} s")
    spec = ModelSpec.from_arch(arch_of(args.model))

    n_in, n_out = args.latency_input_len, args.latency_output_len
    lat = HFRunner(model, n_in + n_out, args.device)
    prompt = latency_prompt(args, config.vocab_size)
    start = time.perf_counter()
    for _ in range(2):  # compile, then CUDA-graph recording, both outside the timing
        lat.generate([prompt], min(8, n_out))
    warmup_s = time.perf_counter() - start
    ttft = statistics.median(lat.timed([prompt], 1) for _ in range(args.latency_iters))
    full = statistics.median(lat.timed([prompt], n_out) for _ in range(args.latency_iters))
    decode_s = full - ttft
    util = utilization(latency_decode_work(spec, n_in, n_out, getattr(torch, args.dtype).itemsize), decode_s, ceilings)
    out.put("latency", {"input_len": n_in, "output_len": n_out, "warmup_s": warmup_s, "ttft_ms": ttft * 1e3,
                        "decode_tok_s": (n_out - 1) / decode_s, "mbu": util.mbu, "mfu": util.mfu})
    log(f"HF batch-1 decode {out.data['latency']['decode_tok_s']:.1f} tok/s, MBU {util.mbu:.1%}")

    prompts, output_lens = throughput_workload(args, config.vocab_size)
    out.put("throughput", hf_throughput(args, model, prompts, output_lens))
    out.put("dynamo", dynamo_counts())
    out.put("memory", gpu_memory(args.device))
    log(f"HF throughput {out.data['throughput']['output_tok_s']:.1f} useful output tok/s "
        f"({out.data['throughput']['num_requests_finished']} of {args.num_requests} requests)")


def hf_throughput(args: argparse.Namespace, model: Any, prompts: list[list[int]],
                  output_lens: list[int]) -> dict[str, Any]:
    """Static batches in arrival order until the time cap; the batch that would cross it is not
    started, so the requests run are a prefix of the workload."""
    runner = HFRunner(model, 2 * args.max_len, args.device)
    size = args.hf_batch_size
    batches = [(prompts[i:i + size], output_lens[i:i + size]) for i in range(0, len(prompts), size)]
    start = time.perf_counter()
    for batch, _ in {len(b): (b, n) for b, n in batches}.values():  # compile each batch size once, untimed
        runner.generate(batch, min(4, args.max_len))
    warmup_s = time.perf_counter() - start

    cap = min(args.hf_throughput_cap_s, seconds_left(args))
    elapsed, last, run, generated = 0.0, 0.0, 0, 0
    for batch, lens in batches:
        if run and elapsed + last > cap:
            break
        last = runner.timed(batch, max(lens))
        elapsed += last
        run += len(batch)
        generated += max(lens) * len(batch)
    prompt_tokens = sum(len(p) for p in prompts[:run])
    useful = sum(output_lens[:run])
    return {
        "batch_size": size,
        "num_requests": len(prompts),
        "num_requests_finished": run,
        "complete": run == len(prompts),
        "time_cap_s": cap,
        "warmup_s": warmup_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": useful,
        "generated_tokens": generated,  # padding rows included: what the GPU actually computed
        "elapsed_s": elapsed,
        "output_tok_s": useful / elapsed,
        "total_tok_s": (prompt_tokens + useful) / elapsed,
    }


def dynamo_counts() -> dict[str, int]:
    """Graphs compiled and graph breaks: a break would leave part of the decode step eager."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}
