"""`kvflow plan --validate`: predict W1 and W2 on this machine from its measured ceilings, run
them, and put prediction and measurement side by side.

W1 is `kvflow bench throughput` with its defaults, W2 `kvflow bench latency` with its defaults.
The predictions are roofline ideals built from the same byte and FLOP counts as MBU and MFU
(`kvflow.bench.mbu`): every step takes max(bytes / bandwidth, FLOPs / peak), with

* W2: one prefill step for TTFT, then output_len − 1 decode steps of one token each;
* W1: the prompts' prefill in ceil(prompt tokens / token budget) steps, then the requests
  decoding in waves of max_num_seqs, one step per output token.

"attained" is the fraction of the ideal the engine reached (measured rate / predicted rate,
or predicted time / measured time), so it reads like MBU: higher is better, 1 is the roof.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvflow.analysis.model_spec import DEFAULT_MODEL, PRESETS
from kvflow.bench.ceilings import Ceilings
from kvflow.bench.latency import LatencyWorkload, measure_latency
from kvflow.bench.mbu import (
    EngineShape,
    decode_token_work,
    get_ceilings,
    prefill_work,
    roofline_seconds,
    weights_work,
)
from kvflow.bench.throughput import ThroughputWorkload, measure_throughput
from kvflow.bench.workloads import random_prompts

W1 = ThroughputWorkload()
W2 = LatencyWorkload()


@dataclass(frozen=True)
class Check:
    name: str
    predicted: float
    measured: float
    higher_is_better: bool

    @property
    def attained(self) -> float:
        if self.higher_is_better:
            return self.measured / self.predicted
        return self.predicted / self.measured

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "attained": self.attained}


def _decode_step_seconds(shape: EngineShape, contexts: list[int], ceilings: Ceilings) -> float:
    work = weights_work(shape.spec, shape.dtype_bytes, 1)
    for context in contexts:
        work = work + decode_token_work(shape.spec, context, shape.dtype_bytes)
    return roofline_seconds(work, ceilings)


def predict_latency(shape: EngineShape, w: LatencyWorkload, ceilings: Ceilings) -> tuple[float, float]:
    """W2's ideal (TTFT in s, decode tok/s)."""
    prefill = prefill_work(shape.spec, w.input_len, shape.dtype_bytes) + weights_work(shape.spec, shape.dtype_bytes, 1)
    decode_s = sum(_decode_step_seconds(shape, [w.input_len + k], ceilings) for k in range(1, w.output_len))
    return roofline_seconds(prefill, ceilings), (w.output_len - 1) / decode_s


def predict_throughput(
    shape: EngineShape, prompt_lens: list[int], output_len: int, token_budget: int, max_seqs: int, ceilings: Ceilings
) -> float:
    """W1's ideal elapsed seconds."""
    steps = math.ceil(sum(prompt_lens) / token_budget)
    prefill = weights_work(shape.spec, shape.dtype_bytes, steps)
    for length in prompt_lens:
        prefill = prefill + prefill_work(shape.spec, length, shape.dtype_bytes)
    seconds = roofline_seconds(prefill, ceilings)
    for first in range(0, len(prompt_lens), max_seqs):
        wave = prompt_lens[first:first + max_seqs]
        seconds += sum(_decode_step_seconds(shape, [p + k for p in wave], ceilings) for k in range(1, output_len))
    return seconds


def engine_model(name: str) -> str | None:
    """What the engine loads for the planner's --model: None for the default model, else a path."""
    key = name.strip().lower()
    if key in ("default", DEFAULT_MODEL):
        return None
    if key in PRESETS:
        raise ValueError(f"--validate runs the model, so --model must be the default or a checkpoint, not {name!r}")
    path = Path(name).expanduser()
    return str(path.parent if path.name == "config.json" else path)


def validate(model: str, dtype: str, ceilings_json: str | None) -> dict[str, Any]:
    """Predict, then run W1 and W2 on one engine; the JSON `kvflow plan --validate` prints."""
    from kvflow.config import EngineArgs
    from kvflow.engine.llm_engine import LLMEngine

    args = EngineArgs(model=engine_model(model), dtype=dtype, skip_tokenizer_init=True, disable_log_stats=True)
    engine = LLMEngine(args)
    shape = EngineShape.from_engine(engine)
    ceilings = get_ceilings(ceilings_json, shape.dtype, shape.device)
    sched = engine.config.scheduler
    lens = [len(p) for p in random_prompts(W1.num_prompts, W1.min_input_len, W1.max_input_len,
                                           shape.spec.vocab_size, W1.seed)]
    w1_s = predict_throughput(shape, lens, W1.output_len, sched.max_num_batched_tokens, sched.max_num_seqs, ceilings)
    ttft_s, decode_tok_s = predict_latency(shape, W2, ceilings)
    w1 = measure_throughput(engine, W1, ceilings)
    w2 = measure_latency(engine, W2, ceilings)
    out_tokens = W1.num_prompts * W1.output_len
    checks = [
        Check("W1 output tok/s", out_tokens / w1_s, w1["output_tok_s"], True),
        Check("W1 total tok/s", (out_tokens + sum(lens)) / w1_s, w1["total_tok_s"], True),
        Check(f"W2 TTFT ms ({W2.input_len} tokens)", ttft_s * 1e3, w2["ttft_ms"], False),
        Check("W2 decode tok/s", decode_tok_s, w2["decode_tok_s"], True),
    ]
    return {"model": shape.spec.name, "dtype": shape.dtype, "ceilings": ceilings.to_json(),
            "checks": [c.to_json() for c in checks], "w1": w1, "w2": w2}


def format_validation(result: dict[str, Any]) -> str:
    c = result["ceilings"]
    lines = [
        f"{result['model']} ({result['dtype']}) on {c['device']}: {c['memory_bandwidth_gb_s']:.1f} GB/s, "
        f"{c['peak_flops'] / 1e12:.3f} TFLOP/s {c['dtype']} (measured ceilings)",
        f"{'workload':<28}{'predicted':>12}{'measured':>12}{'attained':>10}",
        *(f"{k['name']:<28}{k['predicted']:>12,.1f}{k['measured']:>12,.1f}{k['attained']:>10.1%}"
          for k in result["checks"]),
        f"MBU / MFU measured: W1 {100 * result['w1']['mbu']:.3g}% / {100 * result['w1']['mfu']:.3g}%, "
        f"W2 decode {100 * result['w2']['mbu']:.3g}% / {100 * result['w2']['mfu']:.3g}%",
    ]
    return "\n".join(lines)
