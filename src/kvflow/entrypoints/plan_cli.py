"""`kvflow plan`: print a roofline / memory plan for a model on an accelerator."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from kvflow.analysis.hardware import Hardware, get_hardware
from kvflow.analysis.model_spec import DEFAULT_MODEL, resolve_model
from kvflow.analysis.planner import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_CONTEXT_LEN,
    PlanResult,
    SpecParams,
    plan,
)
from kvflow.analysis.tensor_parallel import (
    DEFAULT_ALLREDUCE_LATENCY_S,
    TPEstimate,
    tensor_parallel_estimate,
)
from kvflow.kv_cache_spec import QUANTIZED_KV_CACHE_DTYPES

DEFAULT_HARDWARE = "H100-SXM"  # the seeds' reference device


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from err
    if not sizes or any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError("batch sizes must be positive integers")
    return sizes


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="preset name, HF config.json (or its directory), or 'default'",
    )
    parser.add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        help="A100-80GB, H100-SXM, H200, or 'measured' (this machine)",
    )
    parser.add_argument("--dtype", default="bfloat16", help="compute, weight and KV dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *QUANTIZED_KV_CACHE_DTYPES],
                        help="KV storage: auto (--dtype), or fp8 (E4M3) / fp8_e5m2 / int8 codes plus a 2-byte scale "
                             "per head and token")
    parser.add_argument(
        "--context-len",
        type=int,
        default=DEFAULT_CONTEXT_LEN,
        help="tokens of KV each request holds",
    )
    parser.add_argument(
        "--batch-sizes", type=_batch_sizes, default=DEFAULT_BATCH_SIZES, help="e.g. 1,16,64"
    )
    parser.add_argument("--speculative", "--spec-k", dest="spec_k", type=int,
                        help="speculative decoding: k, tokens proposed per step")
    parser.add_argument("--acceptance", "--spec-alpha", dest="spec_alpha", type=float,
                        help="speculative decoding: α, the fraction of proposed tokens accepted")
    parser.add_argument("--draft-cost", "--spec-cost-ratio", dest="spec_cost_ratio", type=float,
                        help="speculative decoding: r, a proposed token's cost over a target decode step's")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int,
                        help="also estimate decode split over N devices joined by all-reduce")
    parser.add_argument("--allreduce-latency-us", type=float, default=DEFAULT_ALLREDUCE_LATENCY_S * 1e6,
                        help="with --tensor-parallel-size: fixed cost of one collective, in µs")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", metavar="PATH", help="also write a roofline PNG here")
    parser.add_argument(
        "--validate",
        action="store_true",
        help="predict W1/W2 from this machine's ceilings, run them, print predicted vs measured",
    )
    parser.add_argument(
        "--ceilings-json",
        metavar="FILE",
        help="with --validate: ceilings from `kvflow bench ceilings --json` instead of measuring",
    )


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plan` on the main CLI's subparsers."""
    parser = subparsers.add_parser("plan", help="roofline / memory plan for a model on a device")
    _add_arguments(parser)
    parser.set_defaults(func=run_plan)
    return parser


def _spec_params(args: argparse.Namespace) -> SpecParams | None:
    given = [args.spec_k, args.spec_alpha, args.spec_cost_ratio]
    if all(v is None for v in given):
        return None
    if any(v is None for v in given):
        raise ValueError("--speculative, --acceptance and --draft-cost go together")
    return SpecParams(args.spec_k, args.spec_alpha, args.spec_cost_ratio)


def run_plan(args: argparse.Namespace) -> int:
    if args.validate:
        return run_validate(args)
    try:
        model = resolve_model(args.model)
        hw = _hardware(args.hardware, args.dtype)
        result = plan(
            model,
            hw,
            dtype=args.dtype,
            batch_sizes=tuple(args.batch_sizes),
            context_len=args.context_len,
            spec=_spec_params(args),
            kv_cache_dtype=args.kv_cache_dtype,
        )
        tp = None
        if args.tensor_parallel_size is not None:
            tp = tensor_parallel_estimate(
                model, hw, args.tensor_parallel_size, result.dtype, result.weight_bits,
                tuple(args.batch_sizes), args.context_len, args.kv_cache_dtype,
                args.allreduce_latency_us * 1e-6,
            )
        if args.plot:
            from kvflow.analysis.roofline_plot import plot_roofline

            plot_roofline(result, args.plot)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"kvflow plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_json()
        if tp is not None:
            out["tensor_parallel"] = asdict(tp)
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(result) + (f"\n\n{format_tensor_parallel(tp)}" if tp else ""))
    return 0


def _hardware(name: str, dtype: str) -> Hardware:
    if name.lower() == "measured":
        from kvflow.bench.ceilings import measured_hardware  # torch is heavy

        return measured_hardware(dtype)
    return get_hardware(name)


def run_validate(args: argparse.Namespace) -> int:
    from kvflow.bench.validate import format_validation, validate  # runs the engine: heavy

    try:
        result = validate(args.model, args.dtype, args.ceilings_json)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"kvflow plan --validate: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_validation(result))
    return 0


def main_plan(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvflow plan", description=__doc__)
    _add_arguments(parser)
    return run_plan(parser.parse_args(argv))


# ---- readable output ----------------------------------------------------------------------


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [header, *rows]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines
    )


def _memory_line(r: PlanResult) -> str:
    """What a request holds: KV growing per token; or (a model with recurrent state) its states,
    whatever its length, beside its attention layers' KV where it has some, and the context from
    which that is less than its attention twin's KV (`ModelSpec.attention_twin`)."""
    m = r.model
    kv = f"{r.kv_bytes_per_token / 1024:,.1f} KiB/token ({_kv_storage(r)})"
    per_request = f"{r.kv_bytes_per_sequence / 1e6:,.1f} MB per {r.context_len}-token request"
    if m.ssm is None:
        return f"KV cache  {kv}; {per_request}"
    twin = m.attention_twin().kv_bytes_per_token(r.dtype, r.kv_cache_dtype)
    held = (f"{m.state_bytes_per_request() / 1e6:,.1f} MB of states (float32) + {kv} of KV; {per_request}"
            if m.hybrid else f"{r.kv_bytes_per_sequence / 1e6:,.1f} MB per request (float32), whatever its length")
    return (f"state     {held}; less than an attention twin's ({twin / 1024:,.1f} KiB/token) from "
            f"{m.state_crossover_tokens(r.dtype, r.kv_cache_dtype):,} tokens")


def _summary(r: PlanResult) -> list[str]:
    m, hw = r.model, r.hardware
    active = f", {r.active_params / 1e9:.2f} B active" if r.active_params != r.params else ""
    window = f", window {m.sliding_window}" if m.sliding_window else ""
    p = r.prefill
    return [
        f"model     {m.name}: {r.params / 1e9:.3f} B params{active}; "
        f"{m.attention_kind} attention{window}",
        f"hardware  {hw.name}: {_gb(hw.memory_bytes)} GB, {hw.memory_bandwidth / 1e9:,.0f} GB/s, "
        f"{hw.peak(r.dtype) / 1e12:,.1f} TFLOP/s {r.dtype}; "
        f"ridge {hw.ridge_point(r.dtype):.0f} FLOP/B",
        f"weights   {_gb(r.weight_bytes)} GB at {r.weight_bits} bits",
        _memory_line(r),
        f"max batch {r.max_batch_size} requests of {r.context_len} tokens fit in memory"
        + (" (the weights alone do not fit)" if r.weight_bytes > hw.memory_bytes else ""),
        f"prefill   TTFT {p.ttft_ms:,.2f} ms for {p.tokens} tokens ({p.bound}-bound)",
    ]


def _kv_storage(r: PlanResult) -> str:
    return r.dtype if r.kv_cache_dtype == "auto" else f"{r.kv_cache_dtype} + scales"


def format_plan(r: PlanResult) -> str:
    decode = _table(
        ["batch", "KV GB", "total GB", "ms/token", "tok/s", "FLOP/B", "bound", "fits"],
        [
            [
                str(x.batch_size),
                _gb(x.kv_bytes),
                _gb(x.total_bytes),
                f"{x.latency_ms:,.2f}",
                f"{x.throughput_tok_s:,.0f}",
                f"{x.arithmetic_intensity:,.1f}",
                x.bound,
                "yes" if x.fits else "NO",
            ]
            for x in r.rows
        ],
    )
    quant = _table(
        ["weight bits", "weights GB", "max batch", "ms/token @1", "tok/s @1"],
        [
            [
                str(q.weight_bits),
                _gb(q.weight_bytes),
                str(q.max_batch_size),
                f"{q.latency_ms:,.2f}",
                f"{q.throughput_tok_s:,.0f}",
            ]
            for q in r.quantization
        ],
    )
    parts = [
        "\n".join(_summary(r)),
        "decode (roofline: max(bytes/bandwidth, FLOPs/peak))",
        decode,
        f"weight quantization (KV stays {_kv_storage(r)})",
        quant,
    ]
    if s := r.speculative:
        parts.append(
            f"speculative k={s.k} alpha={s.alpha} r={s.cost_ratio}: {s.tokens_per_step:.2f} "
            f"tokens/pass, speedup {s.speedup:.2f}x -> {s.latency_ms:,.2f} ms/token, "
            f"{s.throughput_tok_s:,.0f} tok/s at batch 1"
        )
    return "\n\n".join(parts)


def format_tensor_parallel(tp: TPEstimate) -> str:
    head = (
        f"tensor parallel over {tp.size} devices: {tp.allreduces_per_step} all-reduces + 1 logits "
        f"all-gather per step, link {tp.link_bandwidth / 1e9:,.0f} GB/s each way, "
        f"{tp.allreduce_latency_s * 1e6:g} µs per collective; each rank holds "
        f"{tp.kv_fraction_per_rank:.3g} of the KV"
    )
    rows = _table(
        ["batch", "GB/rank", "compute ms", "comm ms", "ms/token", "tok/s", "comm %", "vs 1 device", "fits"],
        [
            [
                str(x.batch_size),
                _gb(x.memory_per_rank),
                f"{x.compute_ms:,.3f}",
                f"{x.comm_ms:,.3f}",
                f"{x.latency_ms:,.3f}",
                f"{x.throughput_tok_s:,.0f}",
                f"{100 * x.comm_share:.0f}",
                f"{x.speedup:.2f}x",
                "yes" if x.fits else "NO",
            ]
            for x in tp.rows
        ],
    )
    p = tp.prefill
    prefill = (f"prefill of {p.tokens} tokens: {p.compute_ms:,.2f} ms compute + {p.comm_ms:,.2f} ms "
               f"collectives = TTFT {p.ttft_ms:,.2f} ms")
    return "\n".join([head, rows, prefill])


if __name__ == "__main__":
    sys.exit(main_plan())
