"""Which matmul path is fastest per shape: bf16 dense, aten's int4 kernel, kvflow's few-row GEMV
(bf16 products; int8 levels at one row), int8pack, torch._int_mm, and dequantize-then-matmul, for
SmolLM2-135M's shapes at decode (M=1) and prefill sizes.

Medians of interleaved runs (A, B, C, A, B, C, ...) so a busy machine slows every candidate alike.
Usage: .venv/bin/python benchmarks/quant_kernels.py [--threads 1] [--rows 1 4 16 64 128 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvflow.quant import int4_gemv
from kvflow.quant.formats import int4_per_group, int8_per_channel
from kvflow.quant.int4pack import Int4Planes, planes_from_affine

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def interleaved(candidates: dict, rounds: int = 9, iters: int = 10) -> dict[str, float]:
    for f in candidates.values():
        f()
    times = {k: [] for k in candidates}
    for _ in range(rounds):
        for k, f in candidates.items():
            t = time.perf_counter()
            for _ in range(iters):
                f()
            times[k].append((time.perf_counter() - t) / iters)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 512])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads={args.threads}; times in ms (median of interleaved runs)")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        wb = w.bfloat16()
        u, scale, minimum = int4_per_group(w, 32, name)
        planes = Int4Planes(planes_from_affine(u, scale, minimum, 4), 32, torch.bfloat16, name)
        q8, s8 = int8_per_channel(w, name)
        s8b, q8t = s8.bfloat16(), q8.t().contiguous()
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            xi = torch.randint(-127, 128, (m, k), dtype=torch.int8)
            cands = {
                "bf16": lambda: F.linear(x, wb),
                "int4_kernel": lambda: sum(torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, sz)
                                           for p, sz in zip(planes.packed, planes.scale_zero)),
                "int4_dequant": lambda: F.linear(x, planes.dequantize(torch.bfloat16)),
                "int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8b),
                "int8_dequant": lambda: F.linear(x, q8.to(torch.bfloat16) * s8b[:, None]),
                "int_mm": lambda: torch._int_mm(xi, q8t),
            }
            gemv = planes.gemv
            if gemv is not None and m <= int4_gemv.MAX_ROWS:
                cands["gemv_bf16"] = lambda: gemv(x, int4_gemv.BF16_PRODUCTS)
                cands["gemv_int8_levels"] = lambda: gemv(x, int4_gemv.INT8_LEVELS)
            r = interleaved(cands, iters=10 if m <= 64 else 3)
            print(f"{name:8s} N={n:5d} K={k:5d} M={m:4d} " + " ".join(f"{c}={t * 1e3:8.3f}" for c, t in r.items()),
                  flush=True)


if __name__ == "__main__":
    main()
