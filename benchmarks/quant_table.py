"""The quality/speed table of docs/performance-journal.md: every quantization method on the default model.

For each method: weight bytes held by the linear layers and the embedding/head, perplexity on the
shipped text (`kvflow eval ppl`'s measure) and its change against float32, greedy agreement with
float32 over a fixed prompt set, batch-1 decode tokens/s (bf16 activations) and the effective
bandwidth that implies (weight bytes × tokens/s). The float
reference is the default GGUF dequantized to float (tests' `.cache/hf-smollm2-135m`, written by
tests/hf_oracle.py); "gguf" is the same file run on its own Q4_1/Q8_0 blocks.

Usage: .venv/bin/python benchmarks/quant_table.py [--max-tokens 4096] [--methods gguf int8 ...]
       [--model gemma3-270m]  (Gemma-3-270M's GGUF, dequantized the same way, instead of SmolLM2)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hf_oracle import default_gguf_path, default_model_hf_dir, gemma3_270m_hf_dir  # noqa: E402

from kvflow.config import EngineArgs  # noqa: E402
from kvflow.engine.llm_engine import LLMEngine  # noqa: E402
from kvflow.eval.perplexity import perplexity  # noqa: E402
from kvflow.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are", "Water boils at", "In 1492, Columbus", "A haiku about the sea:",
           "The best way to learn a language is"]
GREEDY_TOKENS = 32


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for module in model.modules():
        if not hasattr(module, "quant_method"):
            continue
        for t in list(module.parameters(recurse=True)) + list(module.buffers(recurse=True)):
            if t.data_ptr() not in seen and t.dim() >= 1:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def greedy(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    ids = [engine.add_request(f"g{i}", p, params) for i, p in enumerate(PROMPTS)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


def decode_tok_s(engine: LLMEngine, tokens: int = 64) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.add_request("lat", {"prompt_token_ids": list(range(100, 132))}, params)
    engine.step()  # prefill
    start, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        n += len(engine.step()) > 0
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--methods", nargs="+", default=["float32", "bf16", "gguf", "int8", "w8a8", "fp8", "int4",
                                                     "int4-g64", "awq-g64", "mxfp4"])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3-270m"])
    args = ap.parse_args()
    if args.model == "gemma3-270m":
        from kvflow.model.packaged_models import gemma3_270m_path

        float_dir, gguf = str(gemma3_270m_hf_dir()), str(gemma3_270m_path())
    else:
        float_dir, gguf = str(default_model_hf_dir()), str(default_gguf_path())
    rows, reference = [], None
    for method in args.methods:
        kw = dict(model=float_dir, dtype="bfloat16", disable_log_stats=True)
        if method == "float32":
            kw["dtype"] = "float32"
        elif method == "gguf":
            kw["model"] = gguf
        elif method != "bf16":
            name, _, group = method.partition("-g")
            kw.update(quantization=name, group_size=int(group) if group else None)
        engine = LLMEngine(EngineArgs(**kw))
        ppl = perplexity(engine, args.max_tokens, 512, progress=False).perplexity
        tokens = greedy(engine)
        speed = decode_tok_s(engine) if method != "float32" else float("nan")
        if reference is None:
            reference = (ppl, tokens)
        agree = sum(a == b for x, y in zip(tokens, reference[1]) for a, b in zip(x, y)) / (len(PROMPTS) * GREEDY_TOKENS)
        row = {"method": method, "weight_mb": weight_bytes(engine.runner.model) / 1e6, "ppl": ppl,
               "ppl_change_pct": 100 * (ppl / reference[0] - 1), "greedy_agreement": agree, "decode_tok_s": speed}
        rows.append(row)
        print(json.dumps(row), flush=True)
    # Effective GB/s: the weights batch-1 decode reads per token (all of them, once) times tokens/s.
    print("\n| method | weight MB | perplexity | vs float32 | greedy agreement | batch-1 decode tok/s | effective GB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['weight_mb']:.0f} | {r['ppl']:.3f} | {r['ppl_change_pct']:+.2f}% | "
              f"{100 * r['greedy_agreement']:.1f}% | {r['decode_tok_s']:.1f} | {r['weight_mb'] * r['decode_tok_s'] / 1e3:.1f} |")


if __name__ == "__main__":
    main()
