"""How many requests a fixed KV pool holds, with and without per-group KV (issue 12).

    python benchmarks/kv_capacity.py --model gemma3-270m --kv-cache-memory-gb 0.05
    python benchmarks/kv_capacity.py --model path/to/config.json --context-len 4096

For the model's KV layout (read from its config; no weights are loaded) this prints the planner's
KV bytes per token and the engine's block size and pool, then runs the real scheduler and KV
manager on --num-requests identical-length requests (a stand-in runner samples a fixed token, so
no model runs) and reports the most requests that ran at once, the blocks held and the
preemptions. "flat" treats every layer as full attention (one table for all layers, as before
per-group KV); "per-group" is the engine's own layout, where sliding groups free blocks that left
their window; with --kv-budget-tokens N, "sink_window N" gives every request that KV budget
(kvflow.core.kv_eviction; models with one full-attention KV group).

    python benchmarks/kv_capacity.py --model .cache/hf-smollm2-135m --prompt-len 4096 --kv-budget-tokens 1024
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvflow.analysis.model_spec import ModelSpec
from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.kv_eviction import KVEviction
from kvflow.core.request import Request
from kvflow.core.scheduler import Scheduler
from kvflow.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec, kv_layout
from kvflow.model.arch_config import ArchConfig
from kvflow.sampling_params import SamplingParams


def arch_of(model: str) -> ArchConfig:
    from kvflow.model.loader.resolve import load_checkpoint

    path = Path(model)
    if path.name == "config.json":
        return ArchConfig.from_hf(json.loads(path.read_text()))
    return ArchConfig.from_hf(load_checkpoint(model, load_tokenizer=False, load_weights=False).hf_config)


def run(windows: tuple, num_blocks: int, args, eviction: KVEviction | None = None) -> dict:
    kv = KVCacheManager(num_blocks, args.block_size, False, windows)
    scheduler = Scheduler(SchedulerConfig(args.max_num_batched_tokens, args.num_requests), kv, 1 << 30)
    for i in range(args.num_requests):
        scheduler.add_request(Request(str(i), [i] * args.prompt_len, SamplingParams(max_tokens=args.output_len),
                                      args.output_len, frozenset(), eviction=eviction))
    most, peak_blocks, steps = 0, 0, 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        most = max(most, scheduler.num_running)
        peak_blocks = max(peak_blocks, kv.pool.num_blocks - kv.pool.num_free_blocks)
        scheduler.update_from_output(out, {c.request_id: [1] for c in out.chunks if c.sample})
        steps += 1
    return {"most_running": most, "peak_blocks": peak_blocks, "preemptions": scheduler.num_preemptions_total,
            "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="alias, GGUF, HF dir or config.json")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.05)
    parser.add_argument("--dtype-bytes", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-budget-tokens", type=int, default=None, help="also run with this sink_window budget")
    args = parser.parse_args()
    arch = arch_of(args.model)
    specs = arch.kv_cache_specs()
    flat = [FullAttentionSpec(s.num_kv_heads, s.head_dim) if isinstance(s, SlidingWindowSpec) else s for s in specs]
    budget = int(args.kv_cache_memory_gb * 1024**3)
    report = {"model": args.model, "kv_bytes_per_token": ModelSpec.from_arch(arch).kv_bytes_per_token(8 * args.dtype_bytes),
              "workload": {k: getattr(args, k) for k in ("num_requests", "prompt_len", "output_len", "block_size")}}
    for name, layer_specs in (("flat", flat), ("per-group", specs)):
        layout = kv_layout(layer_specs)
        block_bytes = layout.block_bytes(args.block_size, args.dtype_bytes)
        blocks = budget // block_bytes
        report[name] = {"groups": len(layout.groups), "block_bytes": block_bytes, "pool_blocks": blocks,
                        **run(layout.sliding_windows, blocks, args)}
    if args.kv_budget_tokens:
        eviction = KVEviction.resolve("sink_window", args.kv_budget_tokens, args.block_size)
        report[f"sink_window {eviction.budget_tokens}"] = {
            "pool_blocks": report["per-group"]["pool_blocks"],
            **run(kv_layout(specs).sliding_windows, report["per-group"]["pool_blocks"], args, eviction)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
