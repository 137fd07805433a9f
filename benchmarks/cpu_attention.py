"""Decode attention on CPU: the in-place kernel (attention/cpu_paged.py) against the torch path
(gather the blocks, two batched matmuls), on SmolLM2's attention shape, interleaved in one process.

    PYTHONPATH=src .venv/bin/python benchmarks/cpu_attention.py [--rounds 7] [--against no-tiles]

Each case times one layer's attention for a batch of decodes whose contexts are drawn like W1's
(prompts of 32..512 tokens, up to 128 generated), over a shuffled block pool allocated as the
engine's is (`zeros_untouched`: transparent huge pages where the kernel offers them). With
`--layers 30` each case holds 30 layers' pools and times them in turn, so that K/V stream from
memory as in a model's step; with 1 (the default) one layer's pool stays in the caches. Both paths run in
turn within each round, and the table reports the median of the rounds and their ratio; the
machine's load is printed beside it (a shared machine makes every absolute number noisy).
`--against no-tiles` compares the kernel with itself asked for multiply-adds instead of its AMX
scores (its `tiles` argument False) instead of with the torch path.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import time

import torch

from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata
from kvflow.attention.torch_sdpa import TorchSDPABackend
from kvflow.worker.kv_cache import zeros_untouched

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M


def decode_batch(batch: int, seed: int, dtype: torch.dtype, max_context: int):
    rng = random.Random(seed)
    lens = [min(max_context, rng.randint(32, 512) + rng.randint(1, 128)) for _ in range(batch)]
    blocks_each = [-(-n // BLOCK) for n in lens]
    physical = list(range(sum(blocks_each)))
    rng.shuffle(physical)
    tables = [[physical.pop() for _ in range(b)] for b in blocks_each]
    width = max(blocks_each)
    cache = zeros_untouched((2, sum(blocks_each), KV_HEADS, BLOCK, HEAD_DIM), dtype, "cpu")
    cache.copy_(torch.randn(cache.shape))
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1), seq_lens=torch.tensor(lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)]),
        block_size=BLOCK, query_lens_cpu=[1] * batch, seq_lens_cpu=lens,
    )
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
    k, v = (torch.randn(batch, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
    return q, k, v, cache, meta, AttentionLayerSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, None)


def time_layer(backend, layers, repeats: int) -> float:
    """Seconds a layer: `repeats` passes over `layers` (one batch's pools, the same metadata)."""
    start = time.perf_counter()
    for _ in range(repeats):
        for q, k, v, cache, meta, layer in layers:
            meta.plans.clear()  # planned once per step, as in a real step (one plan, many layers)
            backend.forward(q, k, v, cache, meta, layer)
    return (time.perf_counter() - start) / repeats / len(layers)


def without_tiles() -> TorchSDPABackend:
    """The backend with its kernel always asked for multiply-adds, never AMX scores (the kernel's
    last argument)."""
    backend = TorchSDPABackend()
    kernel = backend.kernel
    backend.kernel = lambda *args: kernel(*args[:-1], False)
    return backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=1, help="pools per case, timed in turn (30: from memory)")
    parser.add_argument("--against", default="torch", choices=["torch", "no-tiles"],
                        help="the baseline: the torch path, or the kernel without its AMX scores")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    in_place = TorchSDPABackend()
    if in_place.kernel is None:
        raise SystemExit("the CPU kernel is unavailable here (see the warning above)")
    if args.against == "torch":
        baseline_backend = TorchSDPABackend()
        baseline_backend.kernel = None  # as where it cannot be built: the gather + matmul path
    else:
        baseline_backend = without_tiles()
    baseline = functools.partial(time_layer, baseline_backend)
    rows = []
    for batch_size, max_context in ((1, 160), (16, 640), (64, 640), (128, 640)):
        torch.manual_seed(0)
        layers = [decode_batch(batch_size, 0, dtype, max_context) for _ in range(args.layers)]
        batch = layers[0]
        repeats = max(1, max(3, 200 // batch_size) // args.layers)
        times = {"kernel": [], "torch": []}
        for _ in range(args.rounds):
            times["kernel"].append(time_layer(in_place, layers, repeats))
            times["torch"].append(baseline(layers, repeats))
        kernel_ms, torch_ms = (statistics.median(times[k]) * 1e3 for k in ("kernel", "torch"))
        rows.append({"batch": batch_size, "mean_context": sum(batch[4].seq_lens_cpu) / batch_size,
                     "kernel_ms": round(kernel_ms, 4), "torch_ms": round(torch_ms, 4),
                     "speedup": round(torch_ms / kernel_ms, 2)})
    print(f"dtype {args.dtype}, {torch.get_num_threads()} threads, {args.layers} layers' pools, "
          f"load average {os.getloadavg()[0]:.1f}")
    other = "gather + bmm" if args.against == "torch" else "kernel without tiles"
    print(f"| decodes | mean context | in-place kernel ms/layer | {other} ms/layer | speed-up |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['mean_context']:.0f} | {r['kernel_ms']:.3f} | {r['torch_ms']:.3f} | {r['speedup']:.2f}× |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
