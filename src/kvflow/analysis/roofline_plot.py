"""Draw a plan on its hardware's roofline: attainable FLOP/s = min(peak, intensity × bandwidth).

matplotlib is an optional extra (`pip install kvflow[plot]`), imported only when plotting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvflow.analysis.planner import PlanResult


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise RuntimeError(
            "plotting needs matplotlib: pip install 'kvflow[plot]' (or pip install matplotlib)"
        ) from err
    return Figure, FigureCanvasAgg


def _log_range(lo: float, hi: float, n: int = 200) -> list[float]:
    step = (hi / lo) ** (1.0 / (n - 1))
    return [lo * step**i for i in range(n)]


def plot_roofline(result: PlanResult, path: str | Path) -> Path:
    """Write a PNG with the roof, the ridge point, each decode batch size and the prefill."""
    figure_cls, canvas_cls = _matplotlib()
    hw, dtype = result.hardware, result.dtype
    peak, bandwidth = hw.peak(dtype), hw.memory_bandwidth
    points = [
        (r.arithmetic_intensity, r.flops / (r.latency_ms / 1e3), f"B={r.batch_size}")
        for r in result.rows
    ]
    p = result.prefill
    prefill = (p.arithmetic_intensity, p.flops / (p.ttft_ms / 1e3), f"prefill {p.tokens} tok")

    # Using Figure directly (not pyplot) leaves no global figure state behind.
    fig = figure_cls(figsize=(7.5, 5.0))
    canvas_cls(fig)
    ax = fig.add_subplot()
    ridge = hw.ridge_point(dtype)
    lo = min(0.1, prefill[0], *(x for x, _, _ in points)) / 2
    hi = max(ridge * 10, prefill[0], *(x for x, _, _ in points)) * 2
    xs = _log_range(lo, hi)
    ax.loglog(
        xs, [min(peak, x * bandwidth) for x in xs], color="black", label=f"{hw.name} roof ({dtype})"
    )
    ax.axvline(ridge, color="gray", linestyle=":", label=f"ridge {ridge:.0f} FLOP/B")
    for x, y, label in points:
        ax.scatter([x], [y], color="tab:blue", zorder=3)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, -12), fontsize=8)
    # Prefill in its own marker, labelled above so it cannot hide a decode label.
    ax.scatter([prefill[0]], [prefill[1]], color="tab:red", marker="s", zorder=3)
    ax.annotate(
        prefill[2], prefill[:2], textcoords="offset points", xytext=(-6, 6), ha="right", fontsize=8
    )
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attained FLOP/s")
    ax.set_title(f"{result.model.name}: decode at context {result.context_len}")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out
