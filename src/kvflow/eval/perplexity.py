"""`kvflow eval ppl`: perplexity of a model on the English text shipped with kvflow.

The first `max_tokens` tokens of the text are cut into windows of `context` tokens; each window is
one request whose prompt logprobs give log p(token | earlier tokens of its window). Perplexity is
exp(mean negative log-likelihood) over every token but each window's first.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

from tqdm import tqdm

from kvflow.config import EngineArgs
from kvflow.data import ENGLISH_TEXT, english_text
from kvflow.eval.passkey import add_passkey_parser
from kvflow.sampling_params import SamplingParams


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per token (nats)
    tokens: int  # tokens scored
    windows: int
    context: int


def perplexity(engine, max_tokens: int = 4096, context: int = 512, progress: bool = True) -> PerplexityResult:
    """Over the engine's model (an `LLMEngine`)."""
    if context < 2:
        raise ValueError("context must be >= 2 (a window scores all of its tokens but the first)")
    ids = engine.get_tokenizer().encode(english_text(), add_special_tokens=False)[:max_tokens]
    windows = [ids[i:i + context] for i in range(0, len(ids), context)]
    windows = [w for w in windows if len(w) >= 2]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    pending = {engine.add_request(f"ppl-{i}", {"prompt_token_ids": w}, params): w for i, w in enumerate(windows)}
    total, count = 0.0, 0
    with tqdm(total=len(windows), desc="perplexity", unit="window", disable=not progress) as bar:
        while pending:
            for out in engine.step():
                if not out.finished:
                    continue
                window = pending.pop(out.request_id)
                for p, token in enumerate(window[1:], start=1):
                    total -= out.prompt_logprobs[p][token].logprob
                    count += 1
                bar.update(1)
    nll = total / count
    return PerplexityResult(math.exp(nll), nll, count, len(windows), context)


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="quality measurements")
    eval_sub = p.add_subparsers(title="evaluations")
    ppl = eval_sub.add_parser("ppl", help=f"perplexity on the shipped public-domain text ({ENGLISH_TEXT})")
    ppl.add_argument("--max-tokens", type=int, default=4096, help="tokens of the text to score")
    ppl.add_argument("--context", type=int, default=512, help="tokens per window")
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    EngineArgs.add_cli_args(ppl)
    ppl.set_defaults(func=run_ppl)
    add_passkey_parser(eval_sub)


def run_ppl(args: argparse.Namespace) -> int:
    from kvflow.engine.llm_engine import LLMEngine

    args.disable_log_stats = True  # the progress bar is the report
    engine = LLMEngine(EngineArgs.from_cli_args(args))
    result = perplexity(engine, args.max_tokens, args.context, progress=not args.json)
    if args.json:
        print(json.dumps(asdict(result) | {"model": args.model, "quantization": args.quantization,
                                           "kv_eviction_policy": args.kv_eviction_policy,
                                           "kv_budget_tokens": args.kv_budget_tokens}))
    else:
        print(f"perplexity {result.perplexity:.3f} (nll {result.nll:.4f} nats/token over {result.tokens} tokens, "
              f"{result.windows} windows of {result.context})")
    return 0
