"""w8a8: int8 weights (symmetric, per output channel) and int8 activations quantized per token at
run time (symmetric, per row), multiplied by `torch._int_mm` (oneDNN; VNNI on this CPU) into int32
and rescaled. Per-row activation scales keep a token's result independent of its batch."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.quant.int8 import Int8Method
from kvflow.quant.online import OnlineQuantConfig


class W8A8Channel(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("q_t", q.t().contiguous())  # [K, N]: _int_mm's right operand
        self.register_buffer("scale", scale.float())
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        x_scale = x2.abs().amax(dim=1, keepdim=True) / 127
        x_scale = torch.where(x_scale > 0, x_scale, torch.ones_like(x_scale))
        xq = (x2 / x_scale).round_().clamp_(-127, 127).to(torch.int8)
        y = torch._int_mm(xq, self.q_t).float() * x_scale * self.scale
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.q_t.t()[ids].float() * self.scale[ids, None]).to(self.dtype)  # contiguous rows


class W8A8Method(Int8Method):
    def runtime(self, stored, dtype, name):
        return W8A8Channel(stored["weight"], stored["weight_scale"], dtype)


class W8A8Config(OnlineQuantConfig):
    name = "w8a8"
    method_class = W8A8Method
