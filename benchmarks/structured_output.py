"""Structured output's costs (issue 16): compile time per schema, cold and cached, and the grammar
mask's share of a decode step at batch 1 and 32, for each backend.

    python benchmarks/structured_output.py                      # both backends, CPU, default model
    python benchmarks/structured_output.py --backends guidance --batch-sizes 1 32 --device cuda

Compile: each schema compiled by a fresh compiler (the backend's vocabulary index is built first
and reported apart), then again (a cache hit); medians over --compile-iters fresh compilers.

Mask overhead: the default model decodes --output-len tokens for a batch of identical chat
prompts at temperature 1 (seeded, EOS ignored so every request makes every token), once
unconstrained (A) and once constrained by a JSON schema that cannot end within that many tokens
(B: an array of at least 1000 short strings), alternating A and B --iters times. A step's time
is the median of its decode steps (prefill steps excluded); overhead = B / A - 1. The mask's own
parts are timed inside B: one request's mask job (the grammar library, on a mask thread, started
when the step before ends), how long the engine then settles the jobs before scheduling (waiting
for fresh ones), and applying the mask (the sampler).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import kvflow.model.layers.sampler as sampler_module
from kvflow import EngineArgs, LLMEngine, SamplingParams, StructuredOutputsParams
from kvflow.structured_output.backends import make_backend
from kvflow.structured_output.compiler import GrammarCompiler

SCHEMAS = {
    "person (nested, enum, pattern)": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "address", "role"],
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "role": {"enum": ["admin", "user", "guest"]},
                       "address": {"type": "object", "required": ["city", "zip"],
                                   "properties": {"city": {"type": "string", "maxLength": 15},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "tool call, 3 tools (required)": {
        "type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
             "properties": {"name": {"const": f"tool_{i}"},
                            "arguments": {"type": "object", "properties": {"x": {"type": "integer"}, "q": {"type": "string"}}}}}
            for i in range(3)]}},
    "60 bounded strings": {
        "type": "object", "required": [f"f{i}" for i in range(60)],
        "properties": {f"f{i}": {"type": "string", "maxLength": 30 + i} for i in range(60)}},
}
ENDLESS = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1000}


def measure_compiles(backend_name: str, tokenizer, vocab: int, eos: list[int], iters: int) -> dict:
    start = time.perf_counter()
    backend = make_backend(backend_name, tokenizer.backend, vocab, eos)
    result = {"vocabulary_index_s": time.perf_counter() - start, "schemas": {}}
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputsParams(json=schema).spec
        cold, cached = [], []
        for _ in range(iters):
            compiler = GrammarCompiler(lambda: backend, timeout_s=600)
            cold.append(_timed(lambda: compiler.compile(spec)))
            cached.append(_timed(lambda: compiler.compile(spec)))
        result["schemas"][name] = {"cold_ms": statistics.median(cold) * 1e3, "cached_ms": statistics.median(cached) * 1e3}
    return result


def measure_overhead(engine: LLMEngine, batch: int, output_len: int, iters: int) -> dict:
    tokenizer = engine.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "List some short words as JSON."}], tokenize=True)
    timed = {"fill": [], "wait": [], "apply": []}
    _time_into(engine.structured_output, "_follow", timed["fill"])  # one request's mask job, on a mask thread
    _time_into(engine.structured_output, "settle", timed["wait"])  # the engine thread, before each step
    _time_into(sampler_module, "apply_grammar_bitmask", timed["apply"])
    steps = {"A": [], "B": []}
    parts = {part: [] for part in timed}  # per constrained run: the median time of one step's part
    for _ in range(iters):
        for label in ("A", "B"):
            constraint = StructuredOutputsParams(json=ENDLESS) if label == "B" else None
            params = SamplingParams(temperature=1.0, seed=0, max_tokens=output_len, ignore_eos=True,
                                    structured_outputs=constraint)
            for times in timed.values():
                times.clear()
            steps[label].append(statistics.median(_decode_steps(engine, [prompt] * batch, params)))
            if label == "B":  # (unconstrained steps never ask for a mask)
                for part, times in timed.items():
                    parts[part].append(statistics.median(times))
    a, b = statistics.median(steps["A"]), statistics.median(steps["B"])
    return {"batch": batch, "step_ms_unconstrained": a * 1e3, "step_ms_constrained": b * 1e3, "overhead": b / a - 1,
            "mask_job_ms": statistics.median(parts["fill"]) * 1e3,  # one request's next mask (a mask thread)
            "settle_ms_per_step": statistics.median(parts["wait"]) * 1e3,  # the engine waiting for them
            "apply_ms_per_step": statistics.median(parts["apply"]) * 1e3,
            "runs_ms": {k: [round(v * 1e3, 2) for v in runs] for k, runs in steps.items()}}


def _decode_steps(engine: LLMEngine, prompts: list, params: SamplingParams) -> list[float]:
    for prompt in prompts:
        engine.add_request(None, prompt, params)
    durations = []
    while engine.has_unfinished_requests():
        prefill = any(r.num_uncomputed_tokens > 1 for r in [*engine.scheduler.running, *engine.scheduler.waiting])
        start = time.perf_counter()
        engine.step()
        if not prefill:
            durations.append(time.perf_counter() - start)
    return durations


def _timed(fn: Callable) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _time_into(obj, name: str, into: list[float]) -> None:
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        into.append(time.perf_counter() - start)
        return result

    setattr(obj, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["guidance", "xgrammar"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--compile-iters", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    report = {}
    for backend in args.backends:
        engine = LLMEngine(EngineArgs(structured_outputs_backend=backend, device=args.device, disable_log_stats=True,
                                      max_model_len=512, enable_prefix_caching=False))
        tokenizer = engine.get_tokenizer()
        report[backend] = {
            "compile": measure_compiles(backend, tokenizer, engine.arch.vocab_size, sorted(engine.eos_token_ids),
                                        args.compile_iters),
            "mask": [measure_overhead(engine, b, args.output_len, args.iters) for b in args.batch_sizes],
        }
        del engine
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
