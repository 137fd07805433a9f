"""KV offloading's tiers: TTFT of a repeated long prompt after its blocks left the KV pool,
recomputed vs loaded back from host memory, from disk, or from Redis.

    .venv/bin/python benchmarks/kv_tiers.py [--prompt-len 2048 --rounds 3 --disk-dir DIR --redis-url redis://...]

Each mode is its own engine on the default model, with a pool of two prompts' blocks. A round
runs two filler prompts (fresh tokens, so their blocks are new), which push the repeated prompt's
blocks out of the pool, then the repeated prompt alone; its TTFT is the round's. The first round
only writes the prompt through to the tiers and is not counted. In the disk and Redis modes the
host tier holds a few blocks, so the prompt's blocks are demoted below it and load from there.
Prints one JSON object: per mode the median TTFT (ms), the last repeat's prefix-cache hit tokens
and MiB of KV loaded from the tiers, and whether its tokens equal the recomputed ones. Indicative on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile

from kvflow import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from kvflow.bench.datasets import DEFAULT_VOCAB_SIZE
from kvflow.bench.workloads import random_token_ids

BLOCK_SIZE = 16
SMALL_HOST_GIB = 16 / 1024  # a few of the default model's blocks: the rest are demoted


def engine_for(mode: str, args, num_blocks: int) -> LLMEngine:
    tiers = {
        "recompute": {},
        "host": {"kv_offloading_size": 4.0},
        "disk": {"kv_offloading_size": SMALL_HOST_GIB, "kv_offloading_disk_path": tempfile.mkdtemp(dir=args.disk_dir),
                 "kv_offloading_disk_size": 4.0},
        "redis": {"kv_offloading_size": SMALL_HOST_GIB, "kv_offloading_remote_url": args.redis_url},
    }[mode]
    return LLMEngine(EngineArgs(model=args.model, block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
                                disable_log_stats=True, **tiers))


def settle(engine: LLMEngine) -> None:
    """Wait for the offloading thread to write what it was given (a real server's next request
    would usually come later than the benchmark's)."""
    connector = engine.model_executor.driver_worker.kv_offload
    if connector is not None:
        connector.io.submit(lambda: None).result(timeout=600)


def run_one(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    return out


def measure(mode: str, args, prompt: list[int], rng: random.Random) -> dict:
    # Two prompts' blocks and a few more: the second filler takes nearly all of the repeated prompt's.
    num_blocks = 2 * (-(-(args.prompt_len + args.output_len) // BLOCK_SIZE)) + 8
    engine = engine_for(mode, args, num_blocks)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    ttfts, out, hits, loaded = [], None, 0, 0
    for round_index in range(args.rounds + 1):
        for filler in range(2):
            run_one(engine, f"filler{round_index}.{filler}",
                    random_token_ids(rng, args.prompt_len, DEFAULT_VOCAB_SIZE), params)
        settle(engine)
        before = engine.get_stats()
        out = run_one(engine, f"repeat{round_index}", prompt, params)
        after = engine.get_stats()
        hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
        loaded = after.kv_transfer_bytes_total - before.kv_transfer_bytes_total
        if round_index:
            ttfts.append(out.metrics.time_to_first_token * 1e3)
    engine.shutdown()
    return {"ttft_ms_median": statistics.median(ttfts), "ttft_ms": [round(t, 1) for t in ttfts],
            "hit_tokens": hits, "loaded_mib": round(loaded / (1 << 20), 1), "tokens": list(out.outputs[0].token_ids)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the engine's default model")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--disk-dir", default=None, help="where the disk tier's directory is made (default: /tmp)")
    parser.add_argument("--redis-url", default=None, help="redis://host:port: also measure the Redis tier")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompt = random_token_ids(rng, args.prompt_len, DEFAULT_VOCAB_SIZE)
    modes = ["recompute", "host", "disk"] + (["redis"] if args.redis_url else [])
    results = {mode: measure(mode, args, prompt, rng) for mode in modes}
    recomputed = results["recompute"]["tokens"]
    for mode in modes:
        results[mode]["same_tokens_as_recompute"] = results[mode].pop("tokens") == recomputed
    print(json.dumps({"prompt_len": args.prompt_len, "rounds": args.rounds, **results}, indent=1))


if __name__ == "__main__":
    main()
