"""`kvflow eval passkey`: can the model find a number hidden in a long prompt? (The passkey test of
Mohtashami & Jaggi, 2023; "needle in a haystack".)

Each prompt is filler sentences with one line "The pass key is N. Remember it. N is the pass key."
at a depth (0: the start, 1: the end) of a prompt of about L tokens, ending in "What is the pass
key? The pass key is"; the answer counts when the greedy continuation's first number is N. A
table of depth × length, each cell the share of trials found. It is the question KV eviction
raises: a policy that keeps only the first and the most recent tokens cannot answer from the middle.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import asdict, dataclass

from kvflow.config import EngineArgs
from kvflow.sampling_params import SamplingParams

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeyResult:
    lengths: list[int]
    depths: list[float]
    found: list[list[float]]  # [depth][length]: the share of trials answered


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """About `length` tokens of filler with the key's line at `depth` of it, then the question."""
    needle = tokenizer.encode(f"The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False)
    filler = tokenizer.encode(FILLER, add_special_tokens=False)
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    body = (filler * (length // len(filler) + 1))[:max(0, length - len(needle) - len(question))]
    cut = round(depth * len(body) / len(filler)) * len(filler)  # between two filler runs
    cut = min(cut, len(body))
    return body[:cut] + needle + body[cut:] + question


def passkey(engine, lengths: list[int], depths: list[float], trials: int = 3, seed: int = 0) -> PasskeyResult:
    """Over the engine's model (an `LLMEngine`): every cell's trials run as one batch of requests."""
    tokenizer = engine.get_tokenizer()
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=8, temperature=0)
    keys = {}
    for d, depth in enumerate(depths):
        for n, length in enumerate(lengths):
            for t in range(trials):
                key = rng.randrange(10_000, 100_000)
                request_id = engine.add_request(f"passkey-{d}-{n}-{t}", {
                    "prompt_token_ids": passkey_prompt(tokenizer, length, depth, key)}, params)
                keys[request_id] = (d, n, key)
    found = [[0.0] * len(lengths) for _ in depths]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                d, n, key = keys[out.request_id]
                first = re.search(r"\d+", out.outputs[0].text)
                found[d][n] += (first is not None and first.group() == str(key)) / trials
    return PasskeyResult(lengths, depths, found)


def add_passkey_parser(eval_sub) -> None:
    p = eval_sub.add_parser("passkey", help="find a number hidden at a depth of a long prompt (depth x length table)")
    p.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="where the key sits (0: start, 1: end)")
    p.add_argument("--trials", type=int, default=3, help="keys per cell")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_passkey)


def run_passkey(args: argparse.Namespace) -> int:
    from kvflow.engine.llm_engine import LLMEngine

    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    if not all(0 <= d <= 1 for d in depths) or not all(n >= 16 for n in lengths) or args.trials < 1:
        raise SystemExit("--depths must lie in [0, 1], --lengths be >= 16 tokens and --trials >= 1")
    args.disable_log_stats = True
    engine = LLMEngine(EngineArgs.from_cli_args(args))
    result = passkey(engine, lengths, depths, args.trials, args.seed)
    if args.json:
        print(json.dumps(asdict(result) | {"model": args.model, "kv_eviction_policy": args.kv_eviction_policy,
                                           "kv_budget_tokens": args.kv_budget_tokens}))
        return 0
    print("depth \\ tokens " + " ".join(f"{n:>7}" for n in lengths))
    for depth, row in zip(depths, result.found):
        print(f"{depth:>14} " + " ".join(f"{x:>7.0%}" for x in row))
    return 0
