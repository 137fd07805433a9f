"""`kvflow bench throughput`: offline throughput on random prompts, the whole batch submitted at once."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from kvflow.bench.ceilings import Ceilings
from kvflow.bench.mbu import (
    EngineShape,
    Utilization,
    add_ceilings_argument,
    batch_work,
    get_ceilings,
    utilization,
)
from kvflow.bench.spec_prompts import PROMPT_SETS, chat_prompt_ids
from kvflow.bench.workloads import random_prompts
from kvflow.config import EngineArgs
from kvflow.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class ThroughputWorkload:
    """W1 with its defaults: 128 prompts of 32..512 random tokens, 128 output tokens each."""

    num_prompts: int = 128
    min_input_len: int = 32
    max_input_len: int = 512
    output_len: int = 128
    seed: int = 0
    prompt_set: str = "random"  # or a chat set of bench/spec_prompts.py (speculative decoding's workloads)


def add_throughput_parser(subparsers) -> argparse.ArgumentParser:
    d = ThroughputWorkload()
    p = subparsers.add_parser("throughput", help="offline throughput: many requests at once")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--min-input-len", type=int, default=d.min_input_len)
    p.add_argument("--max-input-len", type=int, default=d.max_input_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--prompt-set", default=d.prompt_set, choices=["random", *PROMPT_SETS],
                   help="random token ids, or chat prompts: grounded (rewrite a passage) or chat")
    add_ceilings_argument(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_throughput)
    return p


@dataclass(frozen=True)
class CountedRun:
    """What `generate_counting_steps` saw: per request, in prompt order, the output tokens it made
    (an aborted one's up to its abort) and whether the deadline aborted it; the engine steps."""

    output_lens: list[int]
    aborted: list[bool]
    steps: int


def generate_counting_steps(engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                            deadline: float | None = None) -> CountedRun:
    """Run all prompts to the end, with one `params` for all or one per prompt; past `deadline` (a
    `time.perf_counter()` instant, checked before each step) the unfinished requests are aborted.

    Drives the engine itself rather than `LLM.generate` because MBU needs the step count: every
    step reads all the weights once, however many requests it holds."""
    final = RequestOutputKind.FINAL_ONLY
    per_prompt = ([sp.clone(output_kind=final) for sp in params] if isinstance(params, list)
                  else [params.clone(output_kind=final)] * len(prompts))
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, per_prompt)]
    produced: dict[str, int] = {}
    aborted: set[str] = set()
    steps = 0
    while engine.has_unfinished_requests():
        if deadline is not None and time.perf_counter() > deadline:
            aborted = {i for i in ids if i not in produced}
            produced |= {o.request_id: len(o.outputs[0].token_ids) for o in engine.abort_request(list(aborted))}
            break
        steps += 1
        for out in engine.step():
            if out.finished:
                produced[out.request_id] = len(out.outputs[0].token_ids)
    return CountedRun([produced[i] for i in ids], [i in aborted for i in ids], steps)


def measure_throughput(engine, workload: ThroughputWorkload, ceilings: Ceilings) -> dict:
    w = workload
    if w.prompt_set == "random":
        prompts = random_prompts(w.num_prompts, w.min_input_len, w.max_input_len, engine.arch.vocab_size, w.seed)
    else:
        prompts = chat_prompt_ids(engine.get_tokenizer(), w.prompt_set, w.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
    # Warmed up as a server is before it answers (LLMEngine.warm_up), as vLLM's engine is by its
    # start-up dummy run: what a first full step and a first batch of decode rows build lazily (the
    # panels of a GGUF model's dense copies: ~180 ms in W1's first decode step) is built before
    # the clock starts. Then a short run, whose steps also decode.
    engine.warm_up()
    generate_counting_steps(engine, prompts[:2], params.clone(max_tokens=4))
    start = time.perf_counter()
    run = generate_counting_steps(engine, prompts, params)
    elapsed = time.perf_counter() - start
    shape = EngineShape.from_engine(engine)
    lengths = [(len(p), n) for p, n in zip(prompts, run.output_lens)]
    util = utilization(batch_work(shape.spec, lengths, run.steps, shape.dtype_bytes, shape.weight_bytes), elapsed, ceilings)
    prompt_tokens, output_tokens = sum(len(p) for p in prompts), sum(run.output_lens)
    spec = engine.get_stats().spec_decoding  # includes the warm-up's few steps
    return {
        "num_prompts": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
        "num_steps": run.steps,
        "mbu": util.mbu,
        "mfu": util.mfu,
        "dtype": shape.dtype,
        "ceilings": ceilings.to_json(),
        "spec_acceptance_rate": None if spec is None else spec.acceptance_rate,
        "spec_mean_acceptance_length": None if spec is None else spec.mean_acceptance_length,
        "spec_num_drafts": None if spec is None else spec.num_drafts,
    }


def run_throughput(args: argparse.Namespace) -> int:
    from kvflow.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    shape = EngineShape.from_engine(engine)
    ceilings = get_ceilings(args.ceilings_json, shape.dtype, shape.device)
    workload = ThroughputWorkload(args.num_prompts, args.min_input_len, args.max_input_len, args.output_len, args.seed,
                                  args.prompt_set)
    r = measure_throughput(engine, workload, ceilings)
    print(json.dumps(r) if args.json else
          f"{r['num_prompts']} requests, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens "
          f"in {r['elapsed_s']:.2f} s ({r['num_steps']} steps)\n"
          f"output: {r['output_tok_s']:.1f} tok/s   total: {r['total_tok_s']:.1f} tok/s   "
          f"{Utilization(r['mbu'], r['mfu']).describe()}"
          + ("" if r["spec_num_drafts"] is None else
             f"\nspeculation: {r['spec_num_drafts']} verifications, acceptance {r['spec_acceptance_rate']:.1%}, "
             f"mean acceptance length {r['spec_mean_acceptance_length']:.2f}"))
    return 0
