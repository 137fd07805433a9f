"""w8a8's product on CPU: activation rows rounded to int8 by a C++ pass (`csrc/int8_rows_cpu.cpp`),
multiplied by oneDNN's int8 GEMM on weights packed once at load, each output row then scaled.

`torch._int_mm` packs no weights and writes int32: at W1's shapes it reached 1.0–3.2 TOPS where
the bfloat16 GEMM reaches 1.6–2.3 TFLOP/s. oneDNN's `qlinear_pointwise` on prepacked weights
(what Inductor's int8 lowering calls) reaches 3.5–4.7 TOPS; with the rounding done in torch ops
(five passes over float32 temporaries) the layer still lost to bfloat16, and here it does not
(docs/performance-journal.md, "w8a8 on oneDNN's packed int8 GEMM").

oneDNN takes one activation scale for the whole input, so the GEMM runs with scale 1 and zero
point 128 (the codes are round(x / s_row) + 128), giving Σ q_x·q_w · s_w per output; the row's
own scale s_row is applied after, in place. Per-row scales keep a token's result independent of
the batch it runs in, and the integer sums are exact, so the codes and sums are those of the
torch path (`W8A8Channel.torch_forward`) and only float rounding differs.

Where the library cannot be built or oneDNN is missing, `available()` is False and the torch
path runs (`W8A8Channel.torch_forward`, which the tests hold this one to).

The library also dequantizes int8 weight-only rows in one pass, for int8's dense product at many
rows (`dequantized_product`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvflow import cpu_extension

SOURCE = Path(__file__).parent / "csrc" / "int8_rows_cpu.cpp"
ZERO_POINT = 128  # the codes are unsigned: VNNI multiplies unsigned activations by signed weights
DEQUANTIZE_ROWS = 4096  # int8 weight-only: rows dequantized per tile (4.7 MB at K = 576 in bfloat16)


def load() -> bool:
    """Whether the operator library is loaded (built first if need be)."""
    return cpu_extension.load_library("kvflow_int8_rows", SOURCE, "the int8 row kernels",
                                      extra_cflags=cpu_extension.WIDE_VECTORS)


def available() -> bool:
    """The C++ rounding and oneDNN's int8 GEMM can run here."""
    return torch.backends.mkldnn.is_available() and load()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 or bfloat16 rows [M, K] (unit stride) → uint8 codes [M, K] (zero point 128) and each
    row's scale [M] (max|x| / 127; 1 for a row of zeros)."""
    codes = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty(x.shape[0], dtype=torch.float32)
    torch.ops.kvflow_int8_rows.quantize_rows(codes, scales, x)
    return codes, scales


def dequantized_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] · (q·scale)ᵀ for int8 weight-only layers at many rows: the weights dequantized to
    x's dtype DEQUANTIZE_ROWS output rows at a time, each tile multiplied while it is in cache.
    Dequantizing the default model's whole 49,152-row head per call took 48–51 ms at 64–128 rows;
    tiles of 4,096 rows, 6–9 ms, against bfloat16's own 3.4–4.8 ms (docs/performance-journal.md)."""
    n, k = q.shape
    tile = torch.empty(min(n, DEQUANTIZE_ROWS), k, dtype=x.dtype)
    if n <= DEQUANTIZE_ROWS:
        torch.ops.kvflow_int8_rows.dequantize_rows(tile, q, scale)
        return torch.nn.functional.linear(x, tile)
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    for start in range(0, n, DEQUANTIZE_ROWS):
        rows = min(n - start, DEQUANTIZE_ROWS)
        torch.ops.kvflow_int8_rows.dequantize_rows(tile[:rows], q[start:start + rows], scale[start:start + rows])
        y[:, start:start + rows] = torch.nn.functional.linear(x, tile[:rows])
    return y


class PackedInt8Weights:
    """q [N, K] int8 and its per-row float32 scale, packed once for oneDNN's GEMM."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.scale = scale.float().contiguous()
        self.zero_points = torch.zeros(q.shape[0], dtype=torch.long)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 or bfloat16 → x·Wᵀ [M, N] in x's dtype, x rounded per row to int8."""
        codes, row_scales = quantize_rows(x)
        y = torch.ops.onednn.qlinear_pointwise(codes, 1.0, ZERO_POINT, self.packed, self.scale, self.zero_points,
                                               None, 1.0, 0, x.dtype, "none", [], "")
        torch.ops.kvflow_int8_rows.scale_rows_(y, row_scales)
        return y
