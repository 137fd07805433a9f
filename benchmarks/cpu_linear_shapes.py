"""SmolLM2's GEMM shapes on CPU, per row count M: F.linear on bf16 weights, the same weights packed
once for oneDNN (quant/packed_linear.py), the panel kernel bf16 layers take up to its row bound
where it runs (quant/panel_linear.py: AMX tiles or AVX-512 BF16 dot products), and the int4 planes
a GGUF runs by default (quant/int4pack.py). Interleaved in one process; medians; against `kvflow
bench ceilings`.

    PYTHONPATH=src .venv/bin/python benchmarks/cpu_linear_shapes.py [--rounds 7] [--copies 30] \
        [--ceilings-json FILE] [--threads N]

`--copies N` cycles over N copies of each weight, so that a call reads its weight from memory as a
model's 30 layers do at decode (1: the weight stays in cache).

Memory-bound at small M: the table gives each call's weight bandwidth (weight bytes / time) as
a fraction of the measured copy bandwidth; compute-bound at large M: FLOP/s as a fraction of the
measured bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from kvflow.bench.ceilings import measure_ceilings
from kvflow.quant import panel_linear
from kvflow.quant.int4pack import Int4Planes, planes_from_affine
from kvflow.quant.packed_linear import PackedWeight

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
ROWS = (1, 4, 16, 64, 128, 512)


def seconds(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--copies", type=int, default=1, help="copies of each weight, cycled (30: read from memory)")
    parser.add_argument("--ceilings-json", default=None, help="reuse `kvflow bench ceilings --json` output")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 on a busy machine: a 2-thread OpenMP team then waits for a descheduled thread)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ceilings_json:
        c = json.loads(open(args.ceilings_json).read())
        bandwidth, peak = c["memory_bandwidth_gb_s"] * 1e9, c["peak_flops"]
    else:
        c = measure_ceilings("bfloat16", "cpu")
        bandwidth, peak = c.memory_bandwidth_gb_s * 1e9, c.peak_flops
    torch.manual_seed(0)
    print(f"ceilings: {bandwidth / 1e9:.1f} GB/s, {peak / 1e12:.2f} TFLOP/s bf16; {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.1f}")
    kernel = 'AMX tiles' if panel_linear.has_tiles() else 'dot products' if panel_linear.available() else 'not here'
    print(f"panel kernel: {kernel}; "
          f"{args.copies} cop{'y' if args.copies == 1 else 'ies'} of each weight")
    print("| layer | M | F.linear µs | oneDNN packed µs | panels µs | int4 planes µs | panels / oneDNN packed "
          "| best: % of bandwidth or peak |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        weights = [(0.02 * torch.randn(n, k)).bfloat16() for _ in range(args.copies)]
        packed = [PackedWeight(w) for w in weights]
        panels = [panel_linear.pack(w) for w in weights] if panel_linear.available() else []
        planes = []
        for _ in range(args.copies):
            u = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            scale, minimum = torch.rand(n, k // 32) * 0.01, -torch.rand(n, k // 32) * 0.08
            planes.append(Int4Planes(planes_from_affine(u, scale, minimum, 4), 32, torch.bfloat16, name))
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            paths = {"dense": lambda: [F.linear(x, w) for w in weights],
                     "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, p.for_rows(m), None, "none", [], "")
                                        for p in packed],
                     "int4": lambda: [p(x) for p in planes]}
            if panels and panel_linear.takes(m, (n, k)):
                paths["panels"] = lambda: [panel_linear.linear(x, p) for p in panels]
            repeats = max(3, 400 // m // args.copies)
            times = {p: [] for p in paths}
            for _ in range(args.rounds):
                for p, fn in paths.items():
                    times[p].append(seconds(fn, repeats) / args.copies)
            med = {p: statistics.median(t) for p, t in times.items()}
            best = min(med.values())
            weight_bytes, flops = n * k * 2, 2 * m * n * k
            frac = max(weight_bytes / best / bandwidth, flops / best / peak)
            panel = f"{med['panels'] * 1e6:.1f}" if "panels" in med else "—"
            ratio = f"{med['onednn'] / med['panels']:.2f}×" if "panels" in med else "—"
            print(f"| {name} {n}×{k} | {m} | {med['dense'] * 1e6:.1f} | {med['onednn'] * 1e6:.1f} | {panel} | "
                  f"{med['int4'] * 1e6:.1f} | {ratio} | {100 * frac:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
