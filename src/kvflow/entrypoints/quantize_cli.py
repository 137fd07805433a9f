"""`kvflow quantize MODEL OUT --method M`: quantize a float checkpoint once and save it, so later
loads skip the rounding (and AWQ's calibration) and give the same logits."""

from __future__ import annotations

import argparse

from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.model.loader.save import save_checkpoint
from kvflow.quant.registry import NOT_SAVED, QUANTIZATION_METHODS


def add_quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a float checkpoint and save it (safetensors + config.json)")
    p.add_argument("model", help="HF directory or .gguf file (a GGUF is dequantized first); 'default' for SmolLM2")
    p.add_argument("out", help="directory to write")
    p.add_argument("--method", required=True, choices=[m for m in QUANTIZATION_METHODS if m not in NOT_SAVED])
    p.add_argument("--group-size", type=int, default=None, help="int4/awq: input channels per scale (32, 64, 128)")
    p.add_argument("--dtype", default="float32", help="dtype of the float tensors left (norms, biases)")
    p.set_defaults(func=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    model = None if args.model == "default" else args.model
    # Engine defaults otherwise, so AWQ calibrates in the same batches as quantizing at load does.
    engine = LLMEngine(EngineArgs(model=model, quantization=args.method, group_size=args.group_size, dtype=args.dtype,
                                  swap_space_gb=0, disable_log_stats=True))
    out = save_checkpoint(engine.runner.model, engine.hf_config, engine.quant_config.to_dict(), engine.tokenizer, args.out)
    group = f", group size {engine.quant_config.group_size}" if engine.quant_config.group_size else ""
    print(f"wrote {out} ({args.method}{group})")
    return 0
