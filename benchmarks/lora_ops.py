"""How to add a step's LoRA deltas, timed on the default model's layer shapes: kvflow's two forms
(kvflow/lora/batch.py) — segments (per run of rows sharing an adapter, two matmuls on exactly those
rows) and masked (every row by the stacked A of the step's slot range, each slot's own rows gathered
and expanded by its own B in one bmm) — against a gathered bmm (the runs' rows gathered into one
zero-padded [adapters, rows, in] batch, the adapters' A and B gathered beside them, two bmm calls,
the result scattered back).

    .venv/bin/python benchmarks/lora_ops.py [--rank 16 --max-loras 16 --repeats 15 --threads N --dtype bfloat16]
    .venv/bin/python benchmarks/lora_ops.py --device cuda --dtype bfloat16 [--model llama-3.1-8b] [--shapes 16x4,2048x4]

On CUDA a "triton" column adds the Triton kernels (kvflow/lora/triton_ops.py), checked against the
torch forms first, and every form is timed by the device (synchronised), not the host.

Each row is one layer at one shape: T rows spread evenly over K adapters (sorted, as the runner
orders them, in slots 0..K-1 as a fresh manager assigns them), K of the slots resident. Times
are medians over interleaved rounds of the whole layer (base matmul + deltas), in microseconds;
"base" is the layer without adapters, the other columns what the deltas add to it; "auto" says
which form `LoRABatch.build` picks for the shape. bfloat16 (the engine's dtype on this CPU) runs
the base as a plain bf16 matmul, not the default GGUF's int4 kernel, so compare the delta
columns with each other, not with "base".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvflow.lora.batch import LoRABatch
from kvflow.lora.layers import LoRAContext, LoRALinear
from kvflow.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

# hidden, intermediate, heads, KV heads, head dim
MODELS = {"smollm2-135m": (576, 1536, 9, 3, 64), "llama-3.1-8b": (4096, 14336, 32, 8, 128)}


def layers(model: str) -> dict:
    hidden, intermediate, heads, kv_heads, head_dim = MODELS[model]
    return {
        "qkv_proj": lambda: QKVParallelLinear(hidden, head_dim, heads, kv_heads),
        "o_proj": lambda: RowParallelLinear(heads * head_dim, hidden),
        "gate_up_proj": lambda: MergedColumnParallelLinear(hidden, [intermediate] * 2),
        "down_proj": lambda: RowParallelLinear(intermediate, hidden),
    }

# (rows, adapters): decode steps (a row per request) and prefill chunks
SHAPES = [(16, 4), (16, 16), (32, 4), (32, 16), (64, 4), (64, 16), (128, 4), (128, 16), (256, 1), (256, 4),
          (512, 4), (2048, 4), (2048, 16)]


def build(make_layer, max_loras: int, rank: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoRALinear:
    base = make_layer().to(dtype).to(device)
    with torch.no_grad():
        base.weight.normal_(0, 0.02)
    layer = LoRALinear(base, max_loras, rank, LoRAContext(), dtype, torch.device(device))
    for slot in range(max_loras):
        layer.set_slot(slot, {i: (torch.randn(rank, base.input_size) * 0.02, torch.randn(size, rank) * 0.02)
                              for i, size in enumerate(base.output_sizes)})
    return layer


class GatheredBmm:
    """The alternative: one padded batch per layer, whatever the number of adapters."""

    def __init__(self, batch: LoRABatch, dtype: torch.dtype, device: str) -> None:
        self.width = max(end - first for _, first, end in batch.segments)
        rows, keep = [], []
        for _, first, end in batch.segments:
            pad = self.width - (end - first)
            rows += [*range(first, end), *[first] * pad]
            keep += [1.0] * (end - first) + [0.0] * pad
        self.rows, self.keep = torch.tensor(rows, device=device), torch.tensor(keep, dtype=dtype, device=device)[:, None]
        self.slots = torch.tensor([slot for slot, _, _ in batch.segments], device=device)

    def __call__(self, layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
        y = layer.base_layer(x)
        xs = (x.index_select(0, self.rows) * self.keep).view(len(self.slots), self.width, -1)  # padding adds 0
        a, b = layer.lora_a.index_select(0, self.slots), layer.lora_b.index_select(0, self.slots)
        delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b)
        return y.index_add_(0, self.rows, delta.view(-1, y.shape[1]))


def timed(fn, calls: int, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="smollm2-135m", choices=list(MODELS), help="whose layer shapes")
    parser.add_argument("--shapes", default=None, help="rows x adapters, e.g. 16x4,2048x4 (default: all)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 on a shared machine: a busy core stalls every multi-threaded op)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, device, cuda = getattr(torch, args.dtype), args.device, args.device.startswith("cuda")
    shapes = SHAPES if args.shapes is None else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    forms = ["segments", "masked", "bmm", *(["triton"] if cuda else [])]
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, {args.model}, rank {args.rank}, "
          f"{args.dtype}")
    print(f"{'layer':<13}{'T':>6}{'K':>4}{'base':>9}" + "".join(f"{f:>10}" for f in forms) + "  auto")
    totals = dict.fromkeys(["base", *forms], 0.0)
    with torch.inference_mode():
        for kind, make_layer in layers(args.model).items():
            layer = build(make_layer, args.max_loras, args.rank, dtype, device)
            a, b = layer.lora_a, layer.lora_b
            for rows, k in shapes:
                x = torch.randn(rows, layer.base_layer.input_size, dtype=dtype, device=device)
                row_slots = [r * k // rows for r in range(rows)]
                segments, masked = (LoRABatch.build(row_slots, dtype, device, masked=m) for m in (False, True))
                auto = "masked" if LoRABatch.build(row_slots, dtype).masked is not None else "segments"
                bmm = GatheredBmm(segments, dtype, device)

                def with_delta(batch: LoRABatch):  # the torch form, whatever the device
                    y = layer.base_layer(x)
                    batch.add_lora(y, x, a, b)
                    return y

                runs = {"base": lambda: layer.base_layer(x), "segments": lambda: with_delta(segments),
                        "masked": lambda: with_delta(masked), "bmm": lambda: bmm(layer, x)}
                if cuda:
                    from kvflow.lora.triton_ops import add_lora

                    def triton_form():
                        y = layer.base_layer(x)
                        add_lora(y, x, a, b, segments, args.rank, layer.out_slices)
                        return y

                    runs["triton"] = triton_form
                for form in forms[1:]:
                    torch.testing.assert_close(runs[form](), runs["segments"](), atol=tol, rtol=tol)
                calls = max(1, 2048 // rows)  # a few milliseconds per sample
                samples: dict[str, list[float]] = {name: [] for name in runs}
                for _ in range(args.repeats):
                    for name, fn in runs.items():
                        samples[name].append(timed(fn, calls, cuda))
                us = {name: statistics.median(v) * 1e6 for name, v in samples.items()}
                for name in totals:
                    totals[name] += us[name]
                print(f"{kind:<13}{rows:>6}{k:>4}{us['base']:>9.0f}"
                      + "".join(f"{us[f] - us['base']:>+10.0f}" for f in forms) + f"  {auto}", flush=True)
    print("sum over all rows: " + ", ".join(f"{name} {t:.0f}" for name, t in totals.items()))


if __name__ == "__main__":
    main()
