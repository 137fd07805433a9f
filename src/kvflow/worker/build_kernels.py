"""`python -m kvflow.worker.build_kernels` (scripts/setup.sh): build every CPU kernel library now,
so that no start pays for it (a first `kvflow serve` after setup built the C++ decode step and the
panel kernel, about half a minute). Each library is built once per machine, CPU and torch version
into kvflow's cache directory (`kvflow.cpu_extension`); without a compiler each says so, and its
torch path runs."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvflow.attention import cpu_kv_write, cpu_paged, cpu_prompt
from kvflow.model.layers import cpu_ops
from kvflow.quant import int4_gemv, int8_rows, panel_linear
from kvflow.worker import cpu_decode


def _prompt_kernel() -> str:
    kernel = cpu_prompt.load()
    if kernel is None:
        return "unavailable (SDPA)"
    return "ready (AMX tiles)" if kernel.keywords["tiles"] else "ready (AVX-512 BF16 dot products)"


def _ready(loaded: bool, otherwise: str = "unavailable (torch path)") -> str:
    return "ready" if loaded else otherwise


# what each library is → how to build it and say what came of it
KERNELS: dict[str, Callable[[], str]] = {
    "paged attention": lambda: _ready(cpu_paged.load_kernel() is not None),
    "KV write": lambda: _ready(cpu_kv_write.load_writer() is not None),
    "prompt attention": _prompt_kernel,
    "fused elementwise (RMSNorm, RoPE, SiLU·up)": lambda: _ready(cpu_ops.load() is not None),
    "int4 GEMV": lambda: _ready(int4_gemv.fast(), "unavailable (aten int4 kernel runs)"),
    "int8 rows (w8a8, int8)": lambda: _ready(int8_rows.load()),
    "panel linear (bf16 products)": lambda: _ready(panel_linear.available(), "unavailable (oneDNN runs)"),
    "decode step": lambda: _ready(cpu_decode.load_native(), "unavailable (Python step)"),
}


def build_all() -> dict[str, str]:
    return {what: build() for what, build in KERNELS.items()}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for what, status in build_all().items():
        print(f"CPU kernel, {what}: {status}", flush=True)
