"""Measure this machine's roofline ceilings: memory bandwidth and peak matmul FLOP/s.

`kvflow bench ceilings` runs both in a few seconds; `kvflow plan --hardware measured` plans
against the result instead of a datasheet.

A ceiling must be the machine's, not one kernel's: MFU above 100% (kvflow's products beating "the
peak") means the peak was measured too low. So the peak is the best of every product kvflow's
matmuls run on (`PRODUCTS`: torch's matmul; on a CPU in bfloat16, oneDNN on a weight packed as the
engine packs it, and the panel kernel where it is built), at square sizes grown until a call takes
long enough and at the engine's tall-skinny shapes (`ENGINE_SHAPES`); bandwidth is the best of a
streaming read and a copy. Which product and shape reached the peak is reported beside it.
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
from kvflow.quant import panel_linear
from kvflow.quant.packed_linear import PackedWeight, should_pack

_TORCH_DTYPES = MappingProxyType(
    {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
)
_DTYPE_ALIASES = MappingProxyType(
    {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
)

DEFAULT_COPY_BYTES = 128 * 2**20  # 128 MiB each way: well beyond CPU L3 and GPU L2 sizes


# (rows, K, N) of products a serving step runs: batches of 256 to 2,048 tokens through small and
# mid-sized models' projections (0.1-8B: hidden 576-4,096, MLP 1,536-14,336 wide).
ENGINE_SHAPES = ((256, 576, 1536), (2048, 576, 1536), (2048, 1536, 576), (1024, 2048, 8192), (1024, 4096, 4096),
                 (512, 4096, 14336))


@dataclass(frozen=True)
class Ceilings:
    memory_bandwidth_gb_s: float
    peak_flops: float  # FLOP/s
    dtype: str
    device: str
    peak_product: str = ""  # which product, at which shape, reached peak_flops

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
    """Bytes/s moved, the best of a streaming read (a sum: decode reads weights and KV, it writes
    little) and a large copy counting the bytes read plus the bytes written (as STREAM's copy, the
    write-allocate read a CPU may add is not counted)."""
    src = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)  # touch every page
    dst = torch.zeros_like(src)
    nbytes = src.numel() * src.element_size()
    copy = 2 * nbytes / _median_seconds(lambda: dst.copy_(src), device, repeats)
    read = nbytes / _median_seconds(lambda: src.sum(), device, repeats)
    return max(copy, read)


Prepared = tuple[Callable[[], object], int]  # a product ready to run, and the rows it multiplies


def _torch_matmul(x: torch.Tensor, w: torch.Tensor) -> Prepared:
    wt = w.t().contiguous()
    return (lambda: x @ wt), x.shape[0]


def _onednn_packed(x: torch.Tensor, w: torch.Tensor) -> Prepared | None:
    if not should_pack(w):
        return None
    packed = PackedWeight(w)
    return (lambda: torch.ops.mkldnn._linear_pointwise(x, packed.for_rows(x.shape[0]), None, "none", [], "")), x.shape[0]


def _panel_kernel(x: torch.Tensor, w: torch.Tensor) -> Prepared | None:
    """On as many rows as the kernel takes (it runs small batches: decode)."""
    n, k = w.shape
    rows = x[:panel_linear.WIDE_MAX_ROWS if n > panel_linear.WIDE_COLUMNS else panel_linear.MAX_ROWS]
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or not panel_linear.takes(rows.shape[0], (n, k)):
        return None
    panels = panel_linear.pack(w)
    return (lambda: panel_linear.linear(rows, panels)), rows.shape[0]


# name → how to prepare it for (x [M, K], w [N, K]): x @ wᵀ; None where it does not run that product here
PRODUCTS: dict[str, Callable[[torch.Tensor, torch.Tensor], Prepared | None]] = {
    "torch matmul": _torch_matmul,
    "oneDNN, weight packed as the engine packs it": _onednn_packed,
    "panel kernel": _panel_kernel,
}


def _product_flops(m: int, k: int, n: int, dtype: torch.dtype, device: str, repeats: int) -> dict[str, float]:
    """FLOP/s of every product that runs an [m, K] x [K, N] here."""
    x = torch.randn(m, k, device=device).to(dtype)
    w = torch.randn(n, k, device=device).to(dtype)
    found = {}
    for name, prepare in PRODUCTS.items():
        prepared = prepare(x, w)
        if prepared is not None:
            run, rows = prepared
            found[name] = 2.0 * rows * k * n / _median_seconds(run, device, repeats)
    return found


def _square_size(dtype: torch.dtype, device: str, max_n: int, target_s: float) -> int:
    """n for which an n×n matmul takes `target_s` (or max_n): growing n keeps slow dtypes (fp16 on
    many CPUs runs at a few GFLOP/s) inside the time budget while fast ones reach a size that saturates."""
    n = min(256, max_n)
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        if _median_seconds(lambda: a @ a, device, 1) >= target_s or n * 2 > max_n:  # noqa: B023 (run at once)
            return n
        n *= 2


def measure_peak_flops(
    dtype: str = "bfloat16",
    device: str = "cpu",
    max_n: int | None = None,
    target_s: float = 0.05,
    repeats: int = 3,
) -> float:
    """The best FLOP/s of any product kvflow runs (`PRODUCTS`), at any shape tried."""
    return measure_peak(dtype, device, max_n, target_s, repeats)[0]


def measure_peak(dtype: str = "bfloat16", device: str = "cpu", max_n: int | None = None, target_s: float = 0.05,
                 repeats: int = 3) -> tuple[float, str]:
    """(FLOP/s, "product at m×k×n") of the best product, over a square size (`_square_size`) and
    the engine's shapes (`ENGINE_SHAPES`) that fit in max_n."""
    max_n = max_n or (8192 if device.startswith("cuda") else 4096)
    tdtype = torch_dtype(dtype)
    square = _square_size(tdtype, device, max_n, target_s)
    best = (0.0, "")
    for m, k, n in [(square, square, square), *(s for s in ENGINE_SHAPES if max(s) <= max_n)]:
        for name, flops in _product_flops(m, k, n, tdtype, device, repeats).items():
            best = max(best, (flops, f"{name} at {m}x{k}x{n}"))
    return best


def measure_ceilings(
    dtype: str = "bfloat16",
    device: str | None = None,
    copy_bytes: int = DEFAULT_COPY_BYTES,
    max_n: int | None = None,
) -> Ceilings:
    device = device or default_device()
    torch_dtype(dtype)  # reject an unsupported dtype before spending time on the copy
    bandwidth = measure_memory_bandwidth(device, copy_bytes)
    flops, product = measure_peak(dtype, device, max_n)
    name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    return Ceilings(bandwidth / 1e9, flops, name, device, product)


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
            f"peak_product           {c.peak_product}",
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
