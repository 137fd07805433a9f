"""fp8: E4M3 weights with one scale per output channel, weight-only.

This CPU has no FP8 matmul (`torch._scaled_mm` on CPU and a plain fp8 → bf16 cast both took ~19 ms
for a 3072×576 matrix, 80× the bf16 matmul), so each call decodes the codes to the model dtype and
multiplies densely: the format is here for its quality and its bytes at rest, not for CPU speed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.quant.formats import fp8_per_channel
from kvflow.quant.int8 import Int8Channel, Int8Method
from kvflow.quant.online import OnlineQuantConfig


class Fp8Channel(Int8Channel):
    """Codes times a per-row scale, as int8's, but always decoded: no kernel reads E4M3 here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))


class Fp8Method(Int8Method):
    stored_spec = {"weight": (torch.float8_e4m3fn, lambda k: k), "weight_scale": (torch.float32, None)}

    def quantize(self, weight, name):
        q, scale = fp8_per_channel(weight, name)
        return {"weight": q, "weight_scale": scale}

    def runtime(self, stored, dtype, name):
        return Fp8Channel(stored["weight"], stored["weight_scale"], dtype)


class Fp8Config(OnlineQuantConfig):
    name = "fp8"
    method_class = Fp8Method
