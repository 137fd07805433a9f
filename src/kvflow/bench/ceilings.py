"""Measure this machine's roofline ceilings: memory bandwidth and peak matmul FLOP/s.

`kvflow bench ceilings` runs both in a few seconds; `kvflow plan --hardware measured` plans
against the result instead of a datasheet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import torch

from kvflow.analysis.hardware import Hardware, peaks

_TORCH_DTYPES = MappingProxyType(
    {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
)
_DTYPE_ALIASES = MappingProxyType(
    {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
)

DEFAULT_COPY_BYTES = 128 * 2**20  # 128 MiB each way: well beyond CPU L3 and GPU L2 sizes


@dataclass(frozen=True)
class Ceilings:
    memory_bandwidth_gb_s: float
    peak_flops: float  # FLOP/s
    dtype: str
    device: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_dtype(name: str) -> torch.dtype:
    key = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in _TORCH_DTYPES:
        raise ValueError(f"cannot time matmuls in {name!r}; use one of {', '.join(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[key]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median wall time of `fn` after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_memory_bandwidth(
    device: str = "cpu", size_bytes: int = DEFAULT_COPY_BYTES, repeats: int = 5
) -> float:
    """Bytes/s of a large tensor copy, counting the bytes read plus the bytes written.

    (Like STREAM's copy, the write-allocate read a CPU may add is not counted.)
    """
    src = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)  # touch every page
    dst = torch.zeros_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * src.element_size() / seconds


def _matmul_seconds(n: int, dtype: torch.dtype, device: str, inner: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def run() -> None:
        for _ in range(inner):
            a @ b

    return _median_seconds(run, device, repeats) / inner


def measure_peak_flops(
    dtype: str = "bfloat16",
    device: str = "cpu",
    max_n: int | None = None,
    target_s: float = 0.05,
    repeats: int = 3,
) -> float:
    """FLOP/s of a square n×n matmul, growing n until one call takes `target_s` (or max_n).

    Growing n instead of fixing it keeps slow dtypes (fp16 on many CPUs runs at a few
    GFLOP/s) inside the time budget while fast ones still reach a size that saturates.
    """
    cuda = device.startswith("cuda")
    max_n = max_n or (8192 if cuda else 4096)
    inner = 10 if cuda else 1  # amortise kernel-launch overhead on a GPU
    tdtype = torch_dtype(dtype)
    n = min(256, max_n)
    while True:
        seconds = _matmul_seconds(n, tdtype, device, inner, repeats)
        if seconds >= target_s or n * 2 > max_n:
            return 2.0 * n**3 / seconds
        n *= 2


def measure_ceilings(
    dtype: str = "bfloat16",
    device: str | None = None,
    copy_bytes: int = DEFAULT_COPY_BYTES,
    max_n: int | None = None,
) -> Ceilings:
    device = device or default_device()
    torch_dtype(dtype)  # reject an unsupported dtype before spending time on the copy
    bandwidth = measure_memory_bandwidth(device, copy_bytes)
    flops = measure_peak_flops(dtype, device, max_n)
    name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    return Ceilings(bandwidth / 1e9, flops, name, device)


def measured_hardware(dtype: str = "bfloat16", device: str | None = None) -> Hardware:
    """This machine's ceilings, measured now (a few seconds), as the planner's Hardware."""
    ceilings = measure_ceilings(dtype=dtype, device=device)
    return Hardware(
        name=f"measured-{ceilings.device}",
        memory_bytes=float(device_memory_bytes(ceilings.device)),
        memory_bandwidth=ceilings.memory_bandwidth_gb_s * 1e9,
        peak_flops=peaks(**{ceilings.dtype: ceilings.peak_flops}),
    )


def device_memory_bytes(device: str) -> int:
    """Total memory of the device: the GPU's HBM, or the host's physical RAM."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ---- CLI ----------------------------------------------------------------------------------


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="bfloat16", help="matmul dtype (default: bfloat16)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_ceilings_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register `ceilings` under `kvflow bench`."""
    parser = bench_subparsers.add_parser(
        "ceilings", help="measure this machine's memory bandwidth and peak matmul FLOP/s"
    )
    _add_arguments(parser)
    parser.set_defaults(func=run_ceilings)
    return parser


def format_ceilings(c: Ceilings) -> str:
    ridge = c.peak_flops / (c.memory_bandwidth_gb_s * 1e9)
    return "\n".join(
        [
            f"device                 {c.device}",
            f"dtype                  {c.dtype}",
            f"memory_bandwidth_gb_s  {c.memory_bandwidth_gb_s:.1f} GB/s",
            f"peak_flops             {c.peak_flops:.3e} FLOP/s ({c.peak_flops / 1e12:.2f} TFLOP/s)",
            f"ridge point            {ridge:.1f} FLOP/byte",
        ]
    )


def run_ceilings(args: argparse.Namespace) -> int:
    try:
        ceilings = measure_ceilings(dtype=args.dtype)
    except ValueError as err:
        print(f"kvflow bench ceilings: {err}", file=sys.stderr)
        return 2
    print(json.dumps(ceilings.to_json(), indent=2) if args.json else format_ceilings(ceilings))
    return 0


def main_ceilings(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvflow bench ceilings", description=__doc__)
    _add_arguments(parser)
    return run_ceilings(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main_ceilings())
