"""`kvflow bench throughput`: offline throughput on random prompts, the whole batch submitted at once."""

from __future__ import annotations

import argparse
import json
import time

from kvflow.bench.workloads import random_prompts
from kvflow.config import EngineArgs
from kvflow.sampling_params import SamplingParams


def add_throughput_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("throughput", help="offline throughput: many requests at once")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--min-input-len", type=int, default=32)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_throughput)
    return p


def run_throughput(args: argparse.Namespace) -> int:
    from kvflow.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    prompts = random_prompts(args.num_prompts, args.min_input_len, args.max_input_len,
                             llm.engine.arch.vocab_size, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], params.clone(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "num_prompts": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
        "dtype": str(llm.engine.config.model.dtype).removeprefix("torch."),
    }
    print(json.dumps(result) if args.json else
          f"{len(prompts)} requests, {prompt_tokens} prompt + {output_tokens} output tokens in {elapsed:.2f} s\n"
          f"output: {result['output_tok_s']:.1f} tok/s   total: {result['total_tok_s']:.1f} tok/s")
    return 0
