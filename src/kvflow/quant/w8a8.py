"""w8a8: int8 weights (symmetric, per output channel) and int8 activations quantized per token at
run time (symmetric, per row), multiplied by `torch._int_mm` (oneDNN; VNNI on this CPU) into int32
and rescaled. Per-row activation scales keep a token's result independent of its batch.

A few input channels carry most of an activation row's magnitude (on SmolLM2-135M: +4.4%
perplexity with plain per-token rounding), so the layers are smoothed first, as SmoothQuant (Xiao
et al., 2023) does: s = max|x|^α / max|w|^(1−α) per input channel moves part of the activations'
range into the weights (W·diag(s), the input divided by s at its source: quant/calibration.py),
α searched per layer for the smallest output error on calibration rows; the identity is a
candidate too. The embedding and the tied head are int8 per row, weight-only: the head's input
keeps its precision (vLLM leaves the head unquantized)."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.quant.calibration import ALPHAS, InputStats
from kvflow.quant.formats import int8_per_channel
from kvflow.quant.int8 import Int8Method
from kvflow.quant.online import CalibratedMethod, OnlineQuantConfig


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float rows [M, K] → int8 codes [M, K] and each row's scale [M, 1] (max|x| / 127; 1 for a row
    of zeros)."""
    x_scale = x.abs().amax(dim=1, keepdim=True) / 127
    x_scale = torch.where(x_scale > 0, x_scale, torch.ones_like(x_scale))
    return (x / x_scale).round_().clamp_(-127, 127).to(torch.int8), x_scale


class W8A8Channel(nn.Module):
    """A linear layer's runtime only: the embedding and head are int8 weight-only (W8A8Config)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("q_t", q.t().contiguous())  # [K, N]: _int_mm's right operand
        self.register_buffer("scale", scale.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]).float())
        y = torch._int_mm(xq, self.q_t).float() * x_scale * self.scale
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


class W8A8Method(CalibratedMethod, Int8Method):
    def runtime(self, stored, dtype, name):
        return W8A8Channel(stored["weight"], stored["weight_scale"])

    def search_scale(self, weight: torch.Tensor, inputs: InputStats, name: str) -> tuple[torch.Tensor, float]:
        """SmoothQuant's s for the α in `ALPHAS` (or none: α reported as -1) whose w8a8 product is
        nearest x·Wᵀ on the sample rows."""
        x = inputs.sample
        reference = x @ weight.t()
        # max|x| over the sample rows, not over every calibration row: the rare tokens with huge
        # activations then do not set the smoothing of all the others (perplexity +0.84% against
        # +1.56% with the overall maximum, on SmolLM2-135M).
        x_max, w_max = x.abs().amax(0).clamp(min=1e-5), weight.abs().amax(0).clamp(min=1e-5)
        best = (float("inf"), None, -1.0)
        for alpha in [-1.0, *ALPHAS]:
            s = torch.ones_like(x_max) if alpha < 0 else x_max.pow(alpha) / w_max.pow(1 - alpha)
            q, w_scale = int8_per_channel(weight * s, name)
            xq, x_scale = quantize_rows(x / s)
            err = ((xq.float() @ q.float().t()) * x_scale * w_scale - reference).pow(2).mean().item()
            if err < best[0]:
                best = (err, s, alpha)
        return best[1], best[2]


class W8A8Config(OnlineQuantConfig):
    name = "w8a8"
    method_class = W8A8Method
    calibrates = True

    def get_quant_method(self, kind: str, prefix: str):
        return W8A8Method(self) if kind == "linear" else Int8Method(self)
