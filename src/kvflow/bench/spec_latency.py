"""`kvflow bench latency --speculative-config JSON`: batch-1 decode with and without speculation,
the measured acceptance α and proposal cost r, and the seeds' predicted speedup beside the
measured one.

Both engines are built from the same flags (one with the speculative config, one without) and
run the same greedy requests alternately, one at a time, so slow phases of a shared machine hit
both alike. Per request the decode phase is timed from the first token to the last.

    α = accepted / proposed tokens
    k = proposed tokens / verifications (the mean k, when it adapts)
    r = proposer seconds per proposed token / the plain engine's seconds per decode step
    predicted = (k·α + 1) / (1 + k·r)   (the seeds' formula, `kvflow plan --speculative`)

The seeds' formula takes verifying k more tokens to be free, as it is on a memory-bound GPU. It
is not free on a CPU, so the report adds c, a verified token's measured cost relative to a plain
decode step ((verifying step − proposer time) / plain step − 1, per proposal), and the prediction
(k·α + 1) / (1 + k·(r + c)).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from kvflow.analysis.planner import speculative_speedup
from kvflow.bench.spec_prompts import chat_prompt_ids
from kvflow.bench.workloads import random_prompts
from kvflow.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class DecodeTotals:
    tokens: int = 0  # decoded after each request's first token
    seconds: float = 0.0
    steps: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def decode_once(engine, prompt: list[int], output_len: int, totals: DecodeTotals | None = None) -> list[int]:
    """Run one greedy request alone; add its decode phase to `totals`; return its tokens."""
    params = SamplingParams(temperature=0, max_tokens=output_len, output_kind=RequestOutputKind.DELTA)
    engine.add_request(None, prompt, params)
    tokens, first, last, steps = [], None, None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            tokens += out.outputs[0].token_ids
            first, last, steps = first or now, now, steps + 1
    if totals is not None and len(tokens) > 1:
        totals.tokens += len(tokens) - 1
        totals.seconds += last - first
        totals.steps += steps - 1
    return tokens


def benchmark_prompts(engine, prompt_set: str, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    if prompt_set == "random":
        return random_prompts(num_prompts, input_len, input_len, engine.arch.vocab_size, seed)
    return chat_prompt_ids(engine.get_tokenizer(), prompt_set, num_prompts)


def measure_speculative_latency(spec_engine, plain_engine, prompts: list[list[int]], output_len: int,
                                num_iters: int) -> dict:
    for engine in (plain_engine, spec_engine):
        decode_once(engine, prompts[0], 8)  # warm-up
    before = spec_engine.speculation.stats.snapshot()
    plain, spec, identical = DecodeTotals(), DecodeTotals(), 0
    for i in range(num_iters):
        for j, prompt in enumerate(prompts):
            order = [(plain_engine, plain), (spec_engine, spec)]
            if (i + j) % 2:
                order.reverse()
            outputs = [decode_once(engine, prompt, output_len, totals) for engine, totals in order]
            identical += outputs[0] == outputs[1]
    stats = spec_engine.speculation.stats
    drafts = stats.num_drafts - before.num_drafts
    proposed = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    proposer_s = stats.proposer_seconds - before.proposer_seconds
    alpha = accepted / proposed if proposed else 0.0
    k = proposed / drafts if drafts else 0.0
    plain_step_s = plain.seconds / plain.steps if plain.steps else 0.0
    r = proposer_s / proposed / plain_step_s if proposed and plain_step_s else 0.0
    verify_step_s = (spec.seconds - proposer_s) / spec.steps if spec.steps else 0.0
    c = (verify_step_s / plain_step_s - 1) / k if k and plain_step_s else 0.0
    return {
        "method": spec_engine.config.speculative.method,
        "num_speculative_tokens": spec_engine.config.speculative.num_speculative_tokens,
        "num_prompts": len(prompts),
        "output_len": output_len,
        "plain_decode_tok_s": plain.tok_s,
        "spec_decode_tok_s": spec.tok_s,
        "speedup": spec.tok_s / plain.tok_s if plain.tok_s else 0.0,
        "alpha": alpha,
        "mean_k": k,
        "r": r,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "predicted_speedup": speculative_speedup(k, alpha, r) if drafts else 1.0,
        "verify_cost": c,
        "predicted_speedup_with_verify_cost": speculative_speedup(k, alpha, r + c) if drafts else 1.0,
        "greedy_outputs_identical": f"{identical}/{num_iters * len(prompts)}",
        "dtype": str(spec_engine.config.model.dtype).removeprefix("torch."),
    }


def run_speculative_latency(args) -> int:
    from kvflow.config import EngineArgs
    from kvflow.engine.llm_engine import LLMEngine

    engine_args = EngineArgs.from_cli_args(args)
    spec_engine = LLMEngine(engine_args)
    engine_args.speculative_config = None
    plain_engine = LLMEngine(engine_args)
    prompts = benchmark_prompts(spec_engine, args.prompt_set, args.num_prompts, args.input_len, args.seed)
    r = measure_speculative_latency(spec_engine, plain_engine, prompts, args.output_len, args.num_iters)
    print(json.dumps(r) if args.json else
          f"{r['method']} k={r['num_speculative_tokens']} on {r['num_prompts']} {args.prompt_set} prompts, "
          f"{r['output_len']} tokens, batch 1 ({r['dtype']})\n"
          f"decode {r['plain_decode_tok_s']:.1f} -> {r['spec_decode_tok_s']:.1f} tok/s: "
          f"speedup {r['speedup']:.2f}x measured, {r['predicted_speedup']:.2f}x predicted "
          f"from alpha {r['alpha']:.2f}, mean k {r['mean_k']:.2f}, r {r['r']:.3f} "
          f"({r['predicted_speedup_with_verify_cost']:.2f}x with the verification's cost c {r['verify_cost']:.3f})\n"
          f"mean acceptance length {r['mean_acceptance_length']:.2f}; "
          f"greedy outputs identical {r['greedy_outputs_identical']}")
    return 0
