"""`kvflow bench disagg`: what disaggregated prefill/decode costs one request on one host.

Three engines of one model: a single engine (the baseline), a prefill engine and a decode engine
joined by a KV store: a directory (`--kv-store DIR`, default a fresh one under /dev/shm) or a Redis
server (`--kv-store redis://HOST:PORT`). Each iteration times one fresh
prompt (its own random tokens, so no prefix cache helps) on the baseline and on the pair,
interleaved so that a noisy machine slows both alike; the median of each is reported:

- TTFT: the baseline's first token; the pair's is the prefill engine's prompt (saving its KV)
  plus the decode engine's first step (loading it, computing the last prompt token, sampling);
- the added TTFT (pair minus baseline), and how much of it is the transfer itself;
- KV-transfer throughput: bytes saved (and loaded) per second of save (load) time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

from kvflow.bench.workloads import random_prompts
from kvflow.config import EngineArgs
from kvflow.sampling_params import RequestOutputKind, SamplingParams

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


def add_disagg_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("disagg", help="disaggregated prefill/decode: KV-transfer MB/s and added TTFT")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--num-iters", type=int, default=5, help="measured runs of each; medians are reported")
    p.add_argument("--kv-store", default=None,
                   help="a directory the two engines share (default: a fresh one under /dev/shm, removed after), "
                        "or redis://HOST:PORT (a Redis server)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_disagg)
    return p


def _time_baseline(engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(None, {"prompt_token_ids": prompt}, FIRST_TOKEN)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _time_pair(pair, prompt: list[int]) -> tuple[float, float, object, object]:
    """(TTFT, prefill seconds, the prefill engine's output, the decode engine's output)."""
    start = time.perf_counter()
    rid = pair.add_prefill(None, {"prompt_token_ids": prompt})
    prefilled = []
    while not prefilled:
        prefilled = pair.step_prefill()
    prefill_s = time.perf_counter() - start
    pair.add_decode(rid, {"prompt_token_ids": prompt}, FIRST_TOKEN)
    outs = []
    while not outs:
        outs = [o for o in pair.step_decode() if o.finished]
    return time.perf_counter() - start, prefill_s, prefilled[0], outs[0]


def measure_disagg(args: argparse.Namespace, store: str) -> dict:
    """`store`: a directory or a redis:// URL."""
    from kvflow.engine.disaggregated import DisaggregatedPrefillDecode
    from kvflow.engine.llm_engine import LLMEngine

    base_args = EngineArgs.from_cli_args(args)
    base_args.disable_log_stats = True

    def engine(role: str | None) -> LLMEngine:
        config = None if role is None else {"kv_role": role, **_store_config(store)}
        return LLMEngine(dataclasses.replace(base_args, kv_transfer_config=config))

    baseline = engine(None)
    pair = DisaggregatedPrefillDecode(engine("kv_producer"), engine("kv_consumer"))
    prompts = random_prompts(args.num_iters + 1, args.input_len, args.input_len, baseline.arch.vocab_size, args.seed)
    _time_baseline(baseline, prompts[0])  # warm-up, on both
    _time_pair(pair, prompts[0])
    runs = []
    for prompt in prompts[1:]:  # fresh tokens each time: no prefix cache helps either side
        base_s = _time_baseline(baseline, prompt)
        runs.append((base_s, *_time_pair(pair, prompt)))
    ttft_base = statistics.median(r[0] for r in runs)
    ttft_pair = statistics.median(r[1] for r in runs)
    saved = [r[3].metrics for r in runs]
    loaded = [r[4].metrics for r in runs]
    mb = statistics.median(m.kv_transfer_bytes for m in loaded) / 1e6
    return {
        "input_len": args.input_len,
        "kv_store": "redis" if store.startswith(("redis://", "rediss://")) else "directory",
        "num_iters": args.num_iters,
        "dtype": str(baseline.config.model.dtype).removeprefix("torch."),
        "kv_mb_per_request": mb,
        "ttft_ms_single_engine": ttft_base * 1e3,
        "ttft_ms_disaggregated": ttft_pair * 1e3,
        "added_ttft_ms": (ttft_pair - ttft_base) * 1e3,
        "save_ms": statistics.median(m.kv_transfer_seconds for m in saved) * 1e3,
        "load_ms": statistics.median(m.kv_transfer_seconds for m in loaded) * 1e3,
        "save_mb_s": statistics.median(m.kv_transfer_bytes / 1e6 / m.kv_transfer_seconds for m in saved),
        "load_mb_s": statistics.median(m.kv_transfer_bytes / 1e6 / m.kv_transfer_seconds for m in loaded),
    }


def _store_config(store: str) -> dict:
    if store.startswith(("redis://", "rediss://")):
        return {"kv_connector": "RedisStoreConnector", "kv_connector_extra_config": {"kv_store_url": store}}
    return {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {"shared_storage_path": store}}


def run_disagg(args: argparse.Namespace) -> int:
    if args.kv_store is not None:
        result = measure_disagg(args, args.kv_store)
    else:
        with tempfile.TemporaryDirectory(prefix="kvflow-kv-", dir="/dev/shm") as store:
            result = measure_disagg(args, store)
    print(json.dumps(result) if args.json else
          f"{result['kv_store']} store, prompt {result['input_len']} tokens, "
          f"KV {result['kv_mb_per_request']:.2f} MB ({result['dtype']})   "
          f"TTFT single {result['ttft_ms_single_engine']:.1f} ms, disaggregated "
          f"{result['ttft_ms_disaggregated']:.1f} ms (+{result['added_ttft_ms']:.1f} ms)   "
          f"save {result['save_ms']:.2f} ms ({result['save_mb_s']:.0f} MB/s), "
          f"load {result['load_ms']:.2f} ms ({result['load_mb_s']:.0f} MB/s)")
    return 0
