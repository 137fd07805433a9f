"""The fused CPU kernels (model/layers/cpu_ops) against the torch code they replace, one op at a
time on SmolLM2-135M's shapes, interleaved in one process.

    PYTHONPATH=src .venv/bin/python benchmarks/cpu_fused_ops.py [--rounds 7] [--dtype bfloat16]

Cases: residual add + RMSNorm over the hidden size, RoPE on q and k, SiLU(gate)·up over the
intermediate size, each for a decode step of 1 and of 64 tokens and a 512-token prefill chunk.
Each round times both paths in turn (the mean of enough calls to fill ~20 ms), and the table
reports the median of the rounds, their ratio, and the machine's load beside it (a shared
machine makes every absolute number noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvflow.model.layers import cpu_ops
from kvflow.model.layers.activation import torch_silu_and_mul
from kvflow.model.layers.reference import Rope, torch_rms_norm, torch_rotary
from kvflow.model.layers.rotary import RotaryEmbedding

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64  # SmolLM2-135M
EPS = 1e-5


def cases(tokens: int, dtype: torch.dtype):
    """(name, fused call, torch call): each call works on fresh-enough inputs of one step."""
    x, residual = torch.randn(tokens, HIDDEN).to(dtype), torch.randn(tokens, HIDDEN).to(dtype)
    weight = torch.ones(HIDDEN, dtype=dtype)
    table = RotaryEmbedding(HEAD_DIM, 8192, 100000.0, None)
    positions = torch.randint(0, 8192, (tokens,))
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    q, k, _ = (t.unflatten(-1, (-1, HEAD_DIM)) for t in qkv.split([HEADS * HEAD_DIM] + 2 * [KV_HEADS * HEAD_DIM], -1))
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE).to(dtype)

    def torch_rope():
        rope = Rope(positions, table.cos, table.sin)  # a fresh lookup, as once per forward pass
        return torch_rotary(q, rope), torch_rotary(k, rope)

    return [
        ("add + rms_norm", lambda: cpu_ops.rms_norm(x, weight, EPS, residual),
         lambda: torch_rms_norm(x, weight, EPS, residual)),
        ("rotary q, k", lambda: cpu_ops.rotary(q, k, positions, table.cos, table.sin), torch_rope),
        ("silu_and_mul", lambda: cpu_ops.silu_and_mul(gate_up), lambda: torch_silu_and_mul(gate_up)),
    ]


def time_call(fn, budget_s: float = 0.02) -> float:
    """Mean seconds per call over about budget_s."""
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget_s:
        fn()
        calls += 1
    return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if cpu_ops.load() is None:
        raise SystemExit("the fused CPU kernels are unavailable here (see the warning above)")
    rows, loads = [], [os.getloadavg()[0]]
    for tokens in (1, 64, 512):
        for name, fused, plain in cases(tokens, dtype):
            times = {"fused": [], "torch": []}
            for _ in range(args.rounds):
                times["fused"].append(time_call(fused))
                times["torch"].append(time_call(plain))
            fused_us, torch_us = (statistics.median(times[p]) * 1e6 for p in ("fused", "torch"))
            rows.append({"op": name, "tokens": tokens, "fused_us": fused_us, "torch_us": torch_us})
    loads.append(os.getloadavg()[0])
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds, "
          f"load average {min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} CPUs")
    print("| op | tokens | fused µs | torch µs | torch / fused |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['tokens']} | {r['fused_us']:.1f} | {r['torch_us']:.1f} | "
              f"{r['torch_us'] / r['fused_us']:.2f}× |")
    print(json.dumps({"dtype": args.dtype, "rows": rows, "load": loads}))


if __name__ == "__main__":
    main()
