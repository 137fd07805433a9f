"""w8a8: int8 weights (symmetric, per output channel) and int8 activations quantized per token at
run time (symmetric, per row), multiplied by `torch._int_mm` (oneDNN; VNNI on this CPU) into int32
and rescaled. Per-row activation scales keep a token's result independent of its batch.

A few input channels carry most of an activation row's magnitude (on SmolLM2-135M: +4.4%
perplexity with plain per-token rounding), so the layers are smoothed first, as SmoothQuant (Xiao
et al., 2023) does: s = max|x|^α / max|w|^(1−α) per input channel moves part of the activations'
range into the weights (W·diag(s), the input divided by s at its source: quant/calibration.py),
α searched per layer for the smallest output error on calibration rows; the identity is a
candidate too. The embedding and the head stay in the model's dtype, as vLLM leaves them: int8
weight-only, the head dequantized its whole 49,152 × 576 weight at every step of more than 32
rows (50 ms a step against bfloat16's 4–6 ms), which cost W1 half its throughput."""

from __future__ import annotations

import torch

from kvflow.quant import int8_rows
from kvflow.quant.base import WeightsModule
from kvflow.quant.calibration import ALPHAS, InputStats
from kvflow.quant.formats import int8_per_channel
from kvflow.quant.int8 import Int8Method
from kvflow.quant.online import CalibratedMethod, OnlineQuantConfig


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float rows [M, K] → int8 codes [M, K] and each row's scale [M, 1] (max|x| / 127; 1 for a row
    of zeros; NaN for a row holding NaN or infinity, whose product is then NaN). x is multiplied
    by the scale's float reciprocal, as the C++ rounding does (quant/int8_rows.py), so both give
    the same codes."""
    peak = x.abs().amax(dim=1, keepdim=True)
    x_scale = torch.where(peak > 0, peak / 127, torch.ones_like(peak))
    x_scale = torch.where(peak.isfinite(), x_scale, torch.full_like(peak, float("nan")))
    return (x * (1 / x_scale)).round_().clamp_(-127, 127).to(torch.int8), x_scale


class W8A8Channel(WeightsModule):
    """A linear layer's runtime: q [N, K] int8 with a float32 scale per output channel, times
    activations rounded to int8 per row. oneDNN's packed GEMM where it runs (int8_rows), else
    `torch._int_mm`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.float())
        # attributes, not buffers: derived from q and scale
        on_cpu = q.device.type == "cpu"
        self.onednn = int8_rows.PackedInt8Weights(q, self.scale) if on_cpu and int8_rows.available() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.onednn is not None and x.dtype in (torch.float32, torch.bfloat16) and rows.shape[0] > 0:
            y = self.onednn(rows if rows.stride(-1) == 1 else rows.contiguous())
        else:
            y = self.torch_forward(rows)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def torch_forward(self, rows: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_rows(rows.float())
        # q's transpose as a view: _int_mm takes a column-major right operand, as fast as a
        # contiguous copy of it or faster (0.17 vs 0.25 ms at 512 x 960 x 576 here)
        return (torch._int_mm(xq, self.q.t()).float() * x_scale * self.scale).to(rows.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weights alone (the activations are rounded at run time too)."""
        return (self.q.float() * self.scale[:, None]).to(dtype or torch.float32)


class W8A8Method(CalibratedMethod, Int8Method):
    def runtime(self, stored, dtype, name, dense_copy=True):
        return W8A8Channel(stored["weight"], stored["weight_scale"])

    def search_scale(self, weight: torch.Tensor, inputs: InputStats, name: str) -> tuple[torch.Tensor, float]:
        """SmoothQuant's s for the α in `ALPHAS` (or none: α reported as -1) whose w8a8 product is
        nearest x·Wᵀ on the sample rows (`weight` as the layer stores it, searched in float32)."""
        x, weight = inputs.sample, weight.float()
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
        return W8A8Method(self) if kind == "linear" else None
