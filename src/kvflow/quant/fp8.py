"""fp8: E4M3 weights with one scale per output channel, weight-only.

This CPU has no FP8 matmul (`torch._scaled_mm` on CPU and a plain fp8 → bf16 cast both took ~19 ms
for a 3072×576 matrix, 80× the bf16 matmul), so each call decodes the codes to the model dtype and
multiplies densely: the format is here for its quality and its bytes at rest, not for CPU speed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.quant.formats import fp8_per_channel
from kvflow.quant.online import OnlineQuantConfig, OnlineQuantMethod


class Fp8Channel(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.scale.dtype
        return self.q.to(dtype) * self.scale[:, None].to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].to(self.scale.dtype) * self.scale[ids, None]


class Fp8Method(OnlineQuantMethod):
    stored_spec = {"weight": (torch.float8_e4m3fn, lambda k: k), "weight_scale": (torch.float32, None)}

    def quantize(self, weight, name):
        q, scale = fp8_per_channel(weight, name)
        return {"weight": q, "weight_scale": scale}

    def runtime(self, stored, dtype, name):
        return Fp8Channel(stored["weight"], stored["weight_scale"], dtype)


class Fp8Config(OnlineQuantConfig):
    name = "fp8"
    method_class = Fp8Method
