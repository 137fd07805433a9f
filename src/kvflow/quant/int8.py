"""int8: weight-only, symmetric, one scale per output channel.

Decode (few rows) runs aten's `_weight_int8pack_mm`; above `KERNEL_MAX_ROWS` rows the weights are
dequantized and multiplied densely (the int8pack kernel is a GEMV-style loop; measured with
`benchmarks/quant_kernels.py`: at M=128 it took 6.0 ms for gate_up 3072×576 against 2.0 ms for
the bf16 matmul, at M=1 0.05 ms against 0.27 ms; one thread, medians of interleaved runs), a
cache-sized tile at a time by a C++ pass where it is built (`int8_rows.dequantized_product`).
bfloat16 calls of up to `int4_gemv.MAX_ROWS` rows take kvflow's GEMV where the CPU has AVX-512
BF16: the same codes as 8-bit affine ones, u = q + 128 with (s, 0) per group of 32 (batch-1
decode ~2× int8pack's on the default model: docs/performance-journal.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.quant import int4_gemv, int8_rows
from kvflow.quant.base import WeightsModule
from kvflow.quant.formats import int8_per_channel
from kvflow.quant.kernel_plan import CallPlan, KernelPlan
from kvflow.quant.layouts import GEMV, WEIGHTS, Layouts
from kvflow.quant.online import OnlineQuantConfig, OnlineQuantMethod

KERNEL_MAX_ROWS = 32


class Int8Channel(WeightsModule):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.to(dtype))
        self.gemv = _gemv_form(q, self.scale)  # an attribute, not a buffer: derived from q and scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.gemv is not None and x2.dtype == torch.bfloat16 and 0 < x2.shape[0] <= int4_gemv.MAX_ROWS:
            return self.gemv(x2).reshape(*x.shape[:-1], -1)
        if x2.shape[0] <= KERNEL_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)
        elif (x2.device.type == "cpu" and x2.dtype == self.scale.dtype and x2.dtype in (torch.float32, torch.bfloat16)
              and int8_rows.load()):
            y = int8_rows.dequantized_product(x2, self.q, self.scale)
        else:
            y = F.linear(x2, self.dequantize(x2.dtype))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def kernel_plan(self, rows: int, dtype: torch.dtype) -> KernelPlan:
        if self.gemv is not None and dtype == torch.bfloat16 and 0 < rows <= int4_gemv.MAX_ROWS:
            return self.gemv.plan()
        return CallPlan(self.forward)

    def layouts(self) -> Layouts:
        return {WEIGHTS: [self.q, self.scale], GEMV: [self.gemv.weight, self.gemv.scale_zero] if self.gemv else []}

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.q.to(self.scale.dtype) * self.scale[:, None]).to(dtype or self.scale.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].to(self.scale.dtype) * self.scale[ids, None]


def _gemv_form(q: torch.Tensor, scale: torch.Tensor) -> int4_gemv.Int4Gemv | None:
    """q [N, K] int8 with a bfloat16 scale per row as kvflow's GEMV weights (u = q + 128,
    w = s·(u − 128) + 0, exactly), or None where that kernel does not run here."""
    n, k = q.shape
    if (q.dtype != torch.int8 or scale.dtype != torch.bfloat16 or q.device.type != "cpu" or k % int4_gemv.GROUP
            or not int4_gemv.fast()):
        return None
    s = scale[:, None].expand(n, k // int4_gemv.GROUP)
    return int4_gemv.Int4Gemv(q.to(torch.int32) + 128, torch.stack([s, torch.zeros_like(s)], -1), 8)


class Int8Method(OnlineQuantMethod):
    stored_spec = {"weight": (torch.int8, lambda k: k), "weight_scale": (torch.float32, None)}

    def quantize(self, weight, name):
        q, scale = int8_per_channel(weight, name)
        return {"weight": q, "weight_scale": scale}

    def runtime(self, stored, dtype, name, dense_copy=True):
        return Int8Channel(stored["weight"], stored["weight_scale"], dtype)


class Int8Config(OnlineQuantConfig):
    name = "int8"
    method_class = Int8Method
