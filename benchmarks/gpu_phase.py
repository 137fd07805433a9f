"""What every phase of benchmarks/gpu_bench.py shares: the workloads, the clock, the result file.

Imported only through gpu_bench.py, which puts this checkout's src/ and this directory on sys.path.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from kvflow.bench.workloads import random_prompts
from kvflow.model.arch_config import ArchConfig

PHASE_MARGIN_S = 15  # a phase ends its measurement this long before it would be killed


def throughput_workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output length of each): the same for every engine and every run with one seed."""
    prompts = random_prompts(args.num_requests, args.min_len, args.max_len, vocab_size, args.seed)
    rng = random.Random(args.seed + 1)  # a stream of its own: prompts stay `random_prompts`' for the seed
    return prompts, [rng.randint(args.min_len, args.max_len) for _ in prompts]


def latency_prompt(args: argparse.Namespace, vocab_size: int) -> list[int]:
    """The prompt `kvflow.bench.latency.measure_latency` draws, so HF decodes after the same one."""
    return random_prompts(1, args.latency_input_len, args.latency_input_len, vocab_size, args.seed)[0]


def max_context(args: argparse.Namespace) -> int:
    """The longest sequence any workload makes: a prompt plus its output."""
    return max(2 * args.max_len, args.latency_input_len + args.latency_output_len)


def arch_of(model_dir: str) -> ArchConfig:
    return ArchConfig.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))


def sync(device: str) -> None:
    """Wait for queued GPU work, so a clock read after it covers that work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def seconds_left(args: argparse.Namespace) -> float:
    return args.deadline - time.time() - PHASE_MARGIN_S


def log(message: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


class ResultFile:
    """A phase's JSON result, rewritten after each step, so a phase killed midway keeps the rest."""

    def __init__(self, path: str) -> None:
        self.path, self.data = Path(path), {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2))


def gpu_memory(device: str) -> dict[str, float]:
    if not device.startswith("cuda"):
        return {}
    return {"gpu_max_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "gpu_max_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}
