"""What `kvflow bench serve` reports: per-request timings → latency statistics, throughput,
goodput under SLOs, and a latency-vs-throughput plot over a concurrency sweep.

Definitions (the seeds' words): TTFT = request start → first content token; ITL = the gaps
between content chunks, pooled over all requests; TPOT = (E2E − TTFT) / (output tokens − 1);
E2E = request start → end of the stream. Goodput = completed requests meeting every given SLO,
per second of benchmark time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.bench.workloads import percentile

SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it; times in seconds."""

    ok: bool
    ttft: float | None = None
    itls: tuple[float, ...] = ()
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None  # one token has no decode phase
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Latency objectives in ms; None = no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, items: Sequence[str]) -> SLO:
        """From ["ttft:500", "tpot:50", ...] as `--goodput` takes them."""
        limits: dict[str, float] = {}
        for item in items:
            name, _, value = item.partition(":")
            if name not in SLO_METRICS or not value:
                raise ValueError(f"goodput objectives are {', '.join(m + ':MS' for m in SLO_METRICS)}; got {item!r}")
            limits[f"{name}_ms"] = float(value)
        return cls(**limits)

    def met_by(self, r: RequestRecord) -> bool:
        checks = [(self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot), (self.e2e_ms, r.e2e)]
        # A request with no TPOT (a single output token) cannot miss a TPOT objective.
        return r.ok and all(limit is None or value is None or value * 1e3 <= limit for limit, value in checks)

    def to_json(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if v is not None}


def stats_ms(values_s: Sequence[float]) -> dict[str, float] | None:
    """mean / p50 / p90 / p99 in milliseconds; None when there is nothing to summarize."""
    if not values_s:
        return None
    ms = [v * 1e3 for v in values_s]
    return {"mean": statistics.fmean(ms), **{f"p{q}": percentile(ms, q) for q in (50, 90, 99)}}


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None) -> dict[str, Any]:
    """The report's measurements (the caller adds what was run: url, model, load)."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    report: dict[str, Any] = {
        "completed": len(done),
        "errors": len(failed),
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_tok_s": output_tokens / duration_s,
        "total_tok_s": (prompt_tokens + output_tokens) / duration_s,
        "ttft_ms": stats_ms([r.ttft for r in done]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itls]),
        "tpot_ms": stats_ms([t for r in done if (t := r.tpot) is not None]),
        "e2e_ms": stats_ms([r.e2e for r in done]),
        # A handful of distinct messages is enough to diagnose; thousands would drown the JSON.
        "error_samples": sorted({r.error for r in failed})[:5],
    }
    if slo is not None:
        good = sum(slo.met_by(r) for r in done)
        report["goodput"] = {"slo_ms": slo.to_json(), "requests": good, "request_throughput": good / duration_s}
    return report


# ---- text ---------------------------------------------------------------------------------


def _stat_line(name: str, s: dict[str, float] | None) -> str:
    if s is None:
        return f"{name:<6} —"
    return f"{name:<6} mean {s['mean']:9.1f}   p50 {s['p50']:9.1f}   p90 {s['p90']:9.1f}   p99 {s['p99']:9.1f} ms"


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{report['completed']} completed, {report['errors']} errors in {report['duration_s']:.2f} s",
        f"requests/s {report['request_throughput']:.2f}   output tok/s {report['output_tok_s']:.1f}   "
        f"total tok/s {report['total_tok_s']:.1f}",
        *(_stat_line(k.upper(), report[f"{k}_ms"]) for k in ("ttft", "itl", "tpot", "e2e")),
    ]
    if good := report.get("goodput"):
        slo = ", ".join(f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in good["slo_ms"].items())
        lines.append(f"goodput {good['request_throughput']:.2f} req/s ({good['requests']} requests met {slo})")
    lines += [f"error: {e}" for e in report["error_samples"]]
    return "\n".join(lines)


# ---- plot ---------------------------------------------------------------------------------


def plot_sweep(reports: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Latency (TTFT and TPOT, p50 and p99) against output tok/s, one point per concurrency."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise RuntimeError("the sweep plot needs matplotlib: pip install 'kvflow[plot]'") from err

    fig = Figure(figsize=(10.0, 4.5))  # Figure, not pyplot: no global figure state
    FigureCanvasAgg(fig)
    xs = [r["output_tok_s"] for r in reports]
    for position, metric in enumerate(("ttft_ms", "tpot_ms"), 1):
        ax = fig.add_subplot(1, 2, position)
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [r[metric][q] if r[metric] else float("nan") for r in reports]
            ax.plot(xs, ys, style, label=q)
        for r, x in zip(reports, xs):
            if r[metric]:
                ax.annotate(f"c={r['concurrency']}", (x, r[metric]["p50"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{metric.removesuffix('_ms').upper()} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{reports[0].get('model', '')} at {reports[0].get('url', '')}: latency vs throughput")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out
