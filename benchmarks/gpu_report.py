"""gpu_bench's report: the phases' results joined into gpu_bench.json, and gpu_bench.md from it.

Ratios are kvflow over HF; a value a failed or skipped phase never measured is None in the JSON
and "—" in the table, never a guess.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

MBU_TARGET = 0.80


def _get(d: dict | None, *keys: str) -> Any:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or theirs is None or theirs == 0 else ours / theirs


def summarize(args: argparse.Namespace, ceilings: dict, kvflow: dict, hf: dict | None) -> dict[str, Any]:
    def both(*keys: str) -> float | None:
        return _ratio(_get(kvflow, *keys), _get(hf, *keys))

    ratios = {"decode_tok_s": both("latency", "decode_tok_s"),
              "throughput_output_tok_s": both("throughput", "output_tok_s"),
              "throughput_total_tok_s": both("throughput", "total_tok_s")}
    mbu = _get(kvflow, "latency", "mbu")
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": str(args.model),
        "dtype": args.dtype,
        "device": ceilings.get("device"),
        "ceilings": ceilings["ceilings"],
        "workloads": {
            "latency": {"input_len": args.latency_input_len, "output_len": args.latency_output_len,
                        "iters": args.latency_iters},
            "throughput": {"num_requests": args.num_requests, "min_len": args.min_len, "max_len": args.max_len,
                           "seed": args.seed, "hf_batch_size": args.hf_batch_size},
        },
        "kvflow": kvflow,
        "hf": hf,
        "ratios_kvflow_over_hf": ratios,
        "goal": {
            "batch1_mbu": mbu,
            "batch1_mbu_target": MBU_TARGET,
            "batch1_mbu_met": None if mbu is None else mbu >= MBU_TARGET,
            "ahead_of_hf_decode": None if ratios["decode_tok_s"] is None else ratios["decode_tok_s"] > 1,
            "ahead_of_hf_throughput": None if ratios["throughput_output_tok_s"] is None
            else ratios["throughput_output_tok_s"] > 1,
        },
    }


def markdown(r: dict[str, Any]) -> str:
    kv, hf, ratios = r["kvflow"], r["hf"], r["ratios_kvflow_over_hf"]
    lat, tput = r["workloads"]["latency"], r["workloads"]["throughput"]
    c, goal, asked = r["ceilings"], r["goal"], tput["num_requests"]
    rows = [
        (f"batch-1 decode, tok/s ({lat['input_len']}-token prompt, {lat['output_len']} new)",
         _num(_get(kv, "latency", "decode_tok_s")), _num(_get(hf, "latency", "decode_tok_s")),
         _num(ratios["decode_tok_s"], "**{:.2f}×**")),
        ("batch-1 decode MBU", _pct(_get(kv, "latency", "mbu")), _pct(_get(hf, "latency", "mbu")), ""),
        ("throughput, output tok/s", _num(_get(kv, "throughput", "output_tok_s")),
         _num(_get(hf, "throughput", "output_tok_s")), _num(ratios["throughput_output_tok_s"], "**{:.2f}×**")),
        ("throughput, total tok/s", _num(_get(kv, "throughput", "total_tok_s")),
         _num(_get(hf, "throughput", "total_tok_s")), _num(ratios["throughput_total_tok_s"], "{:.2f}×")),
        ("throughput, requests run", _requests(_get(kv, "throughput"), asked),
         _requests(_get(hf, "throughput"), asked), ""),
    ]
    kv_tput = _get(kv, "throughput") or {}
    hf_decode = "eager" if _get(hf, "engine", "decode_compile_config") is None else "compiled"
    lines = [
        (f"kvflow vs HF transformers {_get(hf, 'engine', 'transformers') or ''} on "
         f"{_get(r, 'device', 'name') or '?'}, {Path(r['model']).name} (dummy weights), {r['dtype']}, {r['date']}"),
        "",
        (f"Measured in this run: copy bandwidth {c['memory_bandwidth_gb_s']:.0f} GB/s, "
         f"{c['dtype']} matmul {c['peak_flops'] / 1e12:.0f} TFLOP/s."),
        "",
        "| workload | kvflow | HF generate() | kvflow / HF |",
        "|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in rows),
        "",
        (f"Throughput: {asked} requests, prompt and output lengths uniform in {tput['min_len']}–{tput['max_len']} "
         f"(seed {tput['seed']}), EOS ignored; kvflow gets them all at once, HF runs static batches of "
         f"{tput['hf_batch_size']} (left-padded, static cache, {hf_decode} decode step) and is credited only each "
         "request's own output tokens."),
        (f"kvflow throughput MBU {_pct(kv_tput.get('mbu'))}, MFU {_pct(kv_tput.get('mfu'))}, "
         f"{_num(kv_tput.get('num_steps'), '{:.0f}')} steps, {_num(kv_tput.get('num_preemptions'), '{:.0f}')} "
         "preemptions."),
        "",
        (f"Goal (issue 6): batch-1 MBU ≥ {MBU_TARGET:.0%}: {_verdict(goal['batch1_mbu_met'])}; ahead of HF on "
         f"decode: {_verdict(goal['ahead_of_hf_decode'])}; on throughput: {_verdict(goal['ahead_of_hf_throughput'])}."),
    ]
    failed = [f"{name} ({_get(res, 'phase', 'rc')})" for name, res in (("kvflow", kv), ("hf", hf))
              if res is not None and _get(res, "phase", "rc") != 0]
    if failed:
        lines.append(f"Phases that did not finish: {', '.join(failed)}; see gpu_bench.log.")
    return "\n".join(lines) + "\n"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return _num(None if x is None else 100 * x, "{:.1f}%")


def _requests(t: dict | None, asked: int) -> str:
    if t is None:
        return "—"
    note = "" if t["complete"] else f" (stopped at its {t['time_cap_s']:.0f} s cap)"
    return f"{t['num_requests_finished']} of {asked}{note}"


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "NOT met")
