"""Batch decode speed with the KV cache in the model's dtype, fp8 or int8 (interleaved A/B).

    python benchmarks/kv_cache_dtype_ab.py --batch 32 --prompt-len 256 --output-len 64 --rounds 5

One engine per kv_cache_dtype in one process (same model, same budget). Each round runs every
engine once, in rotating order, on the same batch: all prompts prefilled, then timed decode steps
only (a step after every request's prompt is in). Reports per-engine median decode tok/s over the
rounds, its ratio to "auto", and the pool each budget bought (blocks, tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvflow import EngineArgs, LLMEngine, SamplingParams

KV_DTYPES = ("auto", "fp8", "int8")


def decode_rate(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    generated, started = 0, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if started is None:
            # Timing starts once every request has its first token: from here, steps are decodes.
            if all(o.outputs[0].token_ids for o in outs) and len(outs) == len(prompts):
                started = time.perf_counter()
            continue
        generated += len(outs)
    return generated / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.25)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    engines = {kv: LLMEngine(EngineArgs(model=args.model, kv_cache_dtype=kv, kv_cache_memory_gb=args.kv_cache_memory_gb,
                                        max_num_seqs=args.batch, disable_log_stats=True, skip_tokenizer_init=True))
               for kv in KV_DTYPES}
    gen = torch.Generator().manual_seed(0)
    vocab = engines["auto"].arch.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    rates: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
    for r in range(args.rounds):
        order = KV_DTYPES[r % 3:] + KV_DTYPES[:r % 3]
        for kv in order:
            rates[kv].append(decode_rate(engines[kv], prompts, args.output_len))
            engines[kv].reset_prefix_cache()  # every round prefills anew
    base = statistics.median(rates["auto"])
    report = {kv: {"decode_tok_s_median": statistics.median(v), "ratio_to_auto": statistics.median(v) / base,
                   "decode_tok_s_all": v, "num_kv_blocks": engines[kv].num_kv_blocks,
                   "pool_tokens": engines[kv].num_kv_blocks * engines[kv].config.cache.block_size,
                   "model_dtype": str(engines[kv].config.model.dtype)}
              for kv, v in rates.items()}
    if args.json:
        print(json.dumps({"args": vars(args), "results": report}))
        return
    print(f"batch {args.batch}, prompt {args.prompt_len}, {args.output_len} new tokens, {args.rounds} rounds, "
          f"KV budget {args.kv_cache_memory_gb} GB")
    for kv, row in report.items():
        print(f"{kv:5s} decode {row['decode_tok_s_median']:8.1f} tok/s (x{row['ratio_to_auto']:.2f})  "
              f"pool {row['num_kv_blocks']} blocks = {row['pool_tokens']} tokens  [{row['model_dtype']}]")


if __name__ == "__main__":
    main()
