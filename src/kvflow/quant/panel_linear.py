"""bf16 products for decode-sized row counts on weights laid out as 16-column panels
(`csrc/panel_linear_cpu.cpp`): on AMX tiles where the CPU has them, else on AVX-512 BF16 dot
products, from the same panels.

oneDNN's products at 1-512 rows fall short of what the CPU can do. On the Xeon (AMX) they read
the weights at 15-17 GB/s where it reads 23-25; measured on SmolLM2's 30 layers (weights cycling,
2026-11-27): 16 rows 14.9 -> 9.3 ms, 128 rows 28 -> 21 ms, 512 rows 69 -> 60 ms. On the AMD EPYC
(AVX-512 BF16, no AMX) they reach half its bf16 rate at 16 rows, where the dot products here reach
two thirds of it: SmolLM2's layer 0.58 -> 0.36 ms at 16 rows (1.4-2x a product), 1.02-1.18x at 128
rows, level at 512 (docs/performance-journal.md, stop 36). Past 512 rows oneDNN's blocked kernel is as fast
or faster (2x on tiles at 4,096), so larger products stay there (`MAX_ROWS`), and so do an LM
head's past 32 rows.

Each output sums K in one fixed order whatever the row count, so a row's result does not depend
on its batch. Against oneDNN's products the sums differ in order only (1 bf16 ulp in ~1 output of
10,000; tests/quant/test_panel_linear.py).

Built once per machine like the other kernels (kvflow/cpu_extension.py); where it cannot be built
or the CPU has no AVX-512 BF16, `available()` is False and oneDNN runs. A call may ask for dot
products where there are tiles (`tiles=False`), as the tests and benchmarks do.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvflow import cpu_extension

SOURCE = Path(__file__).parent / "csrc" / "panel_linear_cpu.cpp"
MAX_ROWS = 512
# Products with wide outputs (an LM head: 49,152 columns) only up to 32 rows: SmolLM2's head read
# from memory at 16 rows took 2.4 ms on tiles against oneDNN's 2.9, at 64 rows 3.9 against 3.8, at
# 128 rows 6.2 against 4.4-5.0; on dot products 1.05-1.12x oneDNN up to 32 rows, level beyond.
WIDE_COLUMNS, WIDE_MAX_ROWS = 4096, 32


@functools.cache  # once per process: asked before every product
def available() -> bool:
    """The kernel is built here and runs on this CPU (AVX-512 BF16)."""
    return (cpu_extension.load_library("kvflow_panel_linear", SOURCE, "the panel linear kernel",
                                       extra_cflags=cpu_extension.WIDE_VECTORS)
            and torch.ops.kvflow_panel_linear.available())


def has_tiles() -> bool:
    """Products go to AMX tiles: the kernel runs here and the CPU has them."""
    return available() and _tiles_permitted()


@functools.cache
def _tiles_permitted() -> bool:
    return torch.ops.kvflow_panel_linear.has_tiles()


def takes(rows: int, weight_shape: torch.Size | tuple[int, int]) -> bool:
    """An [rows, K] x [N, K] product the kernel runs here: at most MAX_ROWS rows (WIDE_MAX_ROWS
    past WIDE_COLUMNS columns), N a multiple of 16, K of 32."""
    n, k = weight_shape
    return (rows <= (MAX_ROWS if n <= WIDE_COLUMNS else WIDE_MAX_ROWS) and n % 16 == 0 and k % 32 == 0
            and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] as 16-column panels [N / 16, K / 32, 16, 32]: panel p's tile for K slice s holds
    W[16p + j, 32s + 2i + h] at [i, 2j + h] (the B operand's K pairs x columns; for dot products,
    row i is the 16 columns' pair i)."""
    n, k = weight.shape
    return _pairs_as_panels(weight).contiguous().view(torch.bfloat16).view(n // 16, k // 32, 16, 32)


def pack_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gate's and the up's panels of the same columns side by side: [I / 16, 2, K / 32, 16, 32]."""
    n, k = gate.shape
    both = torch.stack([_pairs_as_panels(gate), _pairs_as_panels(up)], dim=1)
    return both.view(torch.bfloat16).view(n // 16, 2, k // 32, 16, 32)


def _pairs_as_panels(weight: torch.Tensor) -> torch.Tensor:
    """W's K pairs as int32s, permuted to the panels' order (a view): moving pairs, not bfloat16s,
    lays out SmolLM2's weights ~6x faster (half a second of a server's start)."""
    n, k = weight.shape
    return weight.contiguous().view(torch.int32).view(n // 16, 16, k // 32, 16).permute(0, 2, 3, 1)


def linear(rows: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None,
           tiles: bool | None = None) -> torch.Tensor:
    """rows [M, K] @ Wᵀ (+ bias) for W packed by `pack`; on tiles or dot products (None: `has_tiles()`)."""
    return _product(rows, panels, bias, False, tiles)


def silu_and_mul(rows: torch.Tensor, panels: torch.Tensor, tiles: bool | None = None) -> torch.Tensor:
    """SiLU(rows W_gateᵀ) * (rows W_upᵀ) for panels by `pack_gated`."""
    return _product(rows, panels, None, True, tiles)


def _product(rows: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, gated: bool,
             tiles: bool | None) -> torch.Tensor:
    out = torch.empty(rows.shape[0], panels.shape[0] * 16, dtype=rows.dtype)
    torch.ops.kvflow_panel_linear.linear(out, rows, panels, bias, gated, has_tiles() if tiles is None else tiles)
    return out
