"""`kvflow bench lora`: W1-style offline throughput with requests spread over 1, 4, 16 LoRA
adapters, against the base model alone, and the adapters' load latency.

Random rank-r PEFT adapters of every linear module (q/k/v/o, gate/up/down) are written for the
engine's model in a temporary directory. Prompt i runs with adapter i mod K; all adapters fit on
the device at once (max_loras = the largest K) and are loaded and activated by a warm-up, so the
runs time steady-state batching. Two engines live side by side, one without LoRA (the base) and
one with it, and the runs are interleaved round by round (`--rounds`, medians reported), so a
machine whose load drifts affects all of them alike. Load latency is measured on the first
loads: disk → host (read, check, cast) and host → device slot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvflow.bench.throughput import ThroughputWorkload
from kvflow.bench.workloads import random_prompts
from kvflow.config import EngineArgs
from kvflow.lora.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, LoRATarget
from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import RequestOutputKind, SamplingParams


def add_lora_bench_parser(subparsers) -> argparse.ArgumentParser:
    d = ThroughputWorkload()
    p = subparsers.add_parser("lora", help="throughput with many LoRA adapters vs the base model, and load latency")
    p.add_argument("--num-adapters", type=int, nargs="+", default=[1, 4, 16], help="adapter counts to mix")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--min-input-len", type=int, default=d.min_input_len)
    p.add_argument("--max-input-len", type=int, default=d.max_input_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of all runs; medians are reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_lora_bench)
    return p


def write_random_adapter(directory: Path, targets: dict[str, LoRATarget], rank: int, seed: int) -> None:
    """A PEFT-format adapter of rank `rank` on every module in `targets`, with random A and B."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, target in targets.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, target.in_features, generator=gen) * 0.02
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(target.out_features, rank, generator=gen) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, directory / WEIGHTS_FILE)
    modules = sorted({name.rsplit(".", 1)[-1] for name in targets})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none"}
    (directory / CONFIG_FILE).write_text(json.dumps(config))


def run_workload(engine, prompts: list[list[int]], params: SamplingParams, loras: list[LoRARequest | None]) -> dict:
    engine.reset_prefix_cache()  # every run computes its prompts: no run finds another's blocks
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(None, prompt, params, lora_request=loras[i % len(loras)])
    output_tokens = 0
    while engine.has_unfinished_requests():
        output_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    elapsed = time.perf_counter() - start
    total = output_tokens + sum(len(p) for p in prompts)
    return {"elapsed_s": elapsed, "output_tok_s": output_tokens / elapsed, "total_tok_s": total / elapsed}


def run_lora_bench(args: argparse.Namespace) -> int:
    from kvflow.engine.llm_engine import LLMEngine

    w = ThroughputWorkload(args.num_prompts, args.min_input_len, args.max_input_len, args.output_len, args.seed)
    params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    counts = sorted(set(args.num_adapters))
    base_args, lora_args = EngineArgs.from_cli_args(args), EngineArgs.from_cli_args(args)
    base_args.enable_lora = False
    lora_args.enable_lora, lora_args.max_loras, lora_args.max_lora_rank = True, max(counts), args.lora_rank
    base, engine = LLMEngine(base_args), LLMEngine(lora_args)
    prompts = random_prompts(w.num_prompts, w.min_input_len, w.max_input_len, engine.arch.vocab_size, w.seed)
    with tempfile.TemporaryDirectory(prefix="kvflow-lora-bench-") as tmp:
        adapters = []
        for i in range(max(counts)):
            write_random_adapter(Path(tmp) / f"adapter{i}", engine.runner.lora.targets, args.lora_rank, seed=i)
            adapters.append(LoRARequest(f"adapter{i}", i + 1, str(Path(tmp) / f"adapter{i}")))
        warm = params.clone(max_tokens=2)
        run_workload(base, prompts[:2], warm, [None])
        run_workload(engine, prompts[:len(adapters)], warm, adapters)  # loads and activates them all
        stats = engine.runner.lora.stats
        load_ms = {"disk_to_host": 1e3 * stats.disk_load_seconds / stats.disk_loads,
                   "host_to_slot": 1e3 * stats.slot_load_seconds / stats.slot_loads,
                   "adapter_mb": engine.runner.lora.load(adapters[0]).nbytes / 2**20}
        runs = {"base": (base, [None]), "base, LoRA enabled": (engine, [None]),
                **{f"{k} adapters": (engine, adapters[:k]) for k in counts}}
        samples: dict[str, list[dict]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, (runner, loras) in runs.items():
                samples[name].append(run_workload(runner, prompts, params, loras))
    results = {"rank": args.lora_rank, "rounds": args.rounds, "load_ms": load_ms,
               "runs": {name: {key: statistics.median(s[key] for s in runs_) for key in runs_[0]}
                        for name, runs_ in samples.items()}}
    for run in results["runs"].values():
        run["vs_base"] = run["output_tok_s"] / results["runs"]["base"]["output_tok_s"]
    print(json.dumps(results) if args.json else _table(results, w))
    return 0


def _table(results: dict, w: ThroughputWorkload) -> str:
    lines = [f"W1-style: {w.num_prompts} prompts of {w.min_input_len}-{w.max_input_len} tokens, {w.output_len} "
             f"output tokens each; rank-{results['rank']} adapters on every linear module; "
             f"medians of {results['rounds']} interleaved rounds",
             f"{'run':<22}{'output tok/s':>14}{'total tok/s':>13}{'vs base':>9}"]
    for name, run in results["runs"].items():
        lines.append(f"{name:<22}{run['output_tok_s']:>14.1f}{run['total_tok_s']:>13.1f}{run['vs_base']:>8.2f}x")
    load = results["load_ms"]
    lines.append(f"adapter load ({load['adapter_mb']:.1f} MiB): disk -> host {load['disk_to_host']:.1f} ms, "
                 f"host -> device slot {load['host_to_slot']:.1f} ms")
    return "\n".join(lines)
