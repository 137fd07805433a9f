"""Which weight layouts pay for their memory: the engine with `--cpu-weight-layouts fast` against
`compact`, and, inside `fast`, the optional layouts one at a time at the kernels they feed.

    PYTHONPATH=src .venv/bin/python benchmarks/weight_layouts.py [--rounds 5] [--model gemma3-270m]

Engines (both built once, then measured in turn each round, medians of the rounds): batch-1 decode
tok/s, decode tok/s of 16 requests at once, and the time of one step of a `--prompt-len` prompt.
Their memory: `kvflow bench memory --cpu-weight-layouts fast` and `compact`, one process each.

Layers (the fast engine's model, its weights as loaded; every layer in turn so the weights come
from memory, as in a step; ms summed over the layers, medians of the rounds):
- gated pairs: SiLU(gate)·up by the pair (its panels up to 512 rows, oneDNN's epilogues past them)
  against the dense copy's plain product and the SiLU·up kernel, the form without them;
- middle layouts: oneDNN's products of 513-1,280 rows on the weights packed for 1 row (what
  `PackedWeight.for_rows` takes there) against those packed for 512 rows, which it would take
  without them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.model.layers import cpu_ops
from kvflow.quant.packed_linear import PackedWeight, packed_linear
from kvflow.sampling_params import SamplingParams


def engine(layouts: str, model: str | None) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model, cpu_weight_layouts=layouts, kv_cache_memory_gb=0.5,
                                disable_log_stats=True))


def decode_tok_s(llm: LLMEngine, batch: int, output_len: int, seed: int) -> float:
    """Decode tokens a second of `batch` requests decoding together (their prompt step excluded)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    vocab = llm.arch.vocab_size
    for r in range(batch):
        llm.add_request(f"d{seed}-{r}", [(seed * 977 + r * 31 + i) % vocab for i in range(16)], params)
    llm.step()  # the prompts
    start = time.perf_counter()
    steps = 0
    while llm.has_unfinished_requests():
        llm.step()
        steps += 1
    return batch * steps / (time.perf_counter() - start)


def prompt_step_s(llm: LLMEngine, prompt_len: int, seed: int) -> float:
    vocab = llm.arch.vocab_size
    llm.add_request(f"p{seed}", [(seed * 131 + i * 7) % vocab for i in range(prompt_len)],
                    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    llm.step()
    elapsed = time.perf_counter() - start
    while llm.has_unfinished_requests():
        llm.step()
    return elapsed


def one_round(llm: LLMEngine, seed: int, prompt_len: int) -> dict[str, float]:
    return {"decode_1": decode_tok_s(llm, 1, 128, 2 * seed), "decode_16": decode_tok_s(llm, 16, 64, 2 * seed + 1),
            "prompt_s": prompt_step_s(llm, prompt_len, seed)}


def compare_engines(args) -> dict:
    """Both engines, warmed up by one untimed round (what first steps lay out), then measured in
    turn, the order alternating from round to round (a shared machine's load drifts)."""
    engines = {name: engine(name, args.model) for name in ("fast", "compact")}
    for llm in engines.values():
        one_round(llm, 1000, args.prompt_len)
    results = {name: {"decode_1": [], "decode_16": [], "prompt_s": []} for name in engines}
    for round_ in range(args.rounds):
        for name in sorted(engines, reverse=bool(round_ % 2)):
            for key, value in one_round(engines[name], round_, args.prompt_len).items():
                results[name][key].append(value)
            print(name, {k: round(v[-1], 3) for k, v in results[name].items()}, f"load {os.getloadavg()[0]:.1f}",
                  flush=True)
    return {"rounds": results, "median": {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}}


def time_ms(product, inputs, rounds: int) -> float:
    """Median over rounds of one pass of `product` over every (weights, x) in `inputs`, ms (after
    one untimed pass: what a first call lays out is not timed)."""
    for item in inputs:
        product(*item)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for item in inputs:
            product(*item)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gated_pairs(model, rows: int, rounds: int) -> dict:
    """The MLPs' SiLU(gate)·up at `rows` rows, by the gated pairs and without them."""
    gate_ups = [layer.mlp.gate_up_proj for layer in model.model.layers]
    x = torch.randn(rows, gate_ups[0].input_size).bfloat16()
    parts = [layer.gguf_parts[0] if hasattr(layer, "gguf_parts") else layer.quant_runtime for layer in gate_ups]
    for part in parts:
        part.silu_and_mul(x)  # lays the pair and its panels out before timing

    def unfused(part, x):
        gate_up = packed_linear(x, part.dense, None)
        return cpu_ops.silu_and_mul(gate_up)

    inputs = [(part, x) for part in parts]
    return {"gated_ms": time_ms(lambda part, x: part.silu_and_mul(x), inputs, rounds),
            "unfused_ms": time_ms(unfused, inputs, rounds)}


def middle_layouts(model, rows: int, rounds: int) -> dict:
    """Every packed weight's product at `rows` rows, on its 1-row (middle) and its 512-row layout."""
    packed = _packed_weights(model)
    for weight in packed:
        weight.for_rows(rows)  # lays the middle layout out before timing
    inputs = {}
    for weight in packed:
        k = weight.main.shape[1]
        inputs.setdefault(k, torch.randn(rows, k).bfloat16())

    def product(layout: str):
        def run(weight: PackedWeight):
            w = weight.for_rows(rows) if layout == "middle" else weight.main
            return torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], w, None, "none", [], "")
        return run

    items = [(w,) for w in packed]
    return {"weights": len(packed), "middle_ms": time_ms(product("middle"), items, rounds),
            "main_ms": time_ms(product("main"), items, rounds)}


def _packed_weights(model) -> list[PackedWeight]:
    """The oneDNN-packed weights the model's int4 layers hold: their dense copies and gated halves."""
    found = []
    for holder in model.modules():
        dense, gated = getattr(holder, "dense", None), getattr(holder, "gated", None)
        found += [dense] if isinstance(dense, PackedWeight) else []
        found += [gated.gate, gated.up] if gated is not None else []
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--model", default=None, help="as `kvflow --model` (default: the default model)")
    parser.add_argument("--part", choices=["engines", "layers", "both"], default="both")
    args = parser.parse_args()
    report = {"cpu": "AMD EPYC" if "AMD" in open("/proc/cpuinfo").read() else "other", "threads": torch.get_num_threads()}
    if args.part in ("engines", "both"):
        report["engines"] = compare_engines(args)
    if args.part in ("layers", "both"):
        model = engine("fast", args.model).runner.model
        report["gated_pairs"] = {rows: gated_pairs(model, rows, args.rounds) for rows in (16, 128, 512, 1024, 2048)}
        report["middle"] = {rows: middle_layouts(model, rows, args.rounds) for rows in (640, 768, 1024, 1280)}
    report["load"] = os.getloadavg()
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
