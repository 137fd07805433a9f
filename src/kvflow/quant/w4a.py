"""w4a8 and w4a4: int4 weights and int8 / int4 activations, the residual stream and down_proj's
input rotated first (quant/rotation.py, QuaRot's method) so that neither has outlier channels.

Weights: symmetric int4 codes q ∈ [−7, 7] (no zero point, so integer products need no correction),
one scale per output channel (`group_size` None, the default) or per group of input channels,
rounded to nearest with each row's (or group's) clipping ratio chosen from `CLIP_RATIOS` for the
smallest squared error: clipping the few largest weights buys a finer grid for all the others.
Activations: symmetric per token at run time (max|x| ↦ 127, or ↦ 7 for w4a4), as w8a8 rounds them,
so a token's result does not depend on its batch.

Products. Per output channel, w4a8 is w8a8's product as it stands (`W8A8Channel`: oneDNN's int8 GEMM
on CPU, `torch._int_mm` elsewhere) on the int4 codes held as int8; w4a4 rounds the rows to ±7 and
multiplies the codes by `torch._int_mm` (exact int32 sums), no int4 kernel existing here. Per group,
both multiply the dequantized rows by the dequantized weights in the model's dtype: correct, not
fast. The embedding and the head stay in the model's dtype (the head untied by the rotation).

`rotate=False` runs the same bits on the unrotated model, for the comparison the rotation is for.
A rotated model is not saved by `kvflow quantize` yet (it would have to record the rotation and the
untied head): `to_dict` refuses, and a checkpoint naming these methods is refused at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.quant.base import WeightsModule
from kvflow.quant.formats import check_finite
from kvflow.quant.online import OnlineQuantConfig, OnlineQuantMethod
from kvflow.quant.rotation import rotate_model
from kvflow.quant.w8a8 import W8A8Channel

WEIGHT_LEVELS = 7  # int4 codes −7..7
CLIP_RATIOS = [1 - i / 20 for i in range(11)]  # 1.0, 0.95, ..., 0.5 of a group's largest magnitude


def int4_symmetric(w: torch.Tensor, group: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → codes q int8 [N, K] in [−7, 7] and scales [N, K / group] (float32), w ≈ q · scale,
    each group's scale the clipped one of least squared error."""
    check_finite(w, name)
    n, k = w.shape
    if k % group:
        raise ValueError(f"{name}: group_size {group} does not divide its {k} input channels")
    g = w.float().reshape(n, k // group, group)
    peak = g.abs().amax(-1, keepdim=True)
    best_err, best_scale = None, None
    for ratio in CLIP_RATIOS:
        scale = torch.where(peak > 0, peak * ratio / WEIGHT_LEVELS, torch.ones_like(peak))
        err = ((g / scale).round().clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS) * scale - g).pow(2).sum(-1, keepdim=True)
        if best_err is None:
            best_err, best_scale = err, scale
        else:
            better = err < best_err
            best_err, best_scale = torch.where(better, err, best_err), torch.where(better, scale, best_scale)
    q = (g / best_scale).round().clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS).to(torch.int8)
    return q.reshape(n, k), best_scale.reshape(n, k // group)


def quantize_rows(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float rows [M, K] → int8 codes in [−levels, levels] and each row's scale [M, 1] (max|x| / levels;
    1 for a row of zeros; NaN for a row holding NaN or infinity, whose product is then NaN)."""
    peak = x.abs().amax(dim=1, keepdim=True)
    x_scale = torch.where(peak > 0, peak / levels, torch.ones_like(peak))
    x_scale = torch.where(peak.isfinite(), x_scale, torch.full_like(peak, float("nan")))
    return (x * (1 / x_scale)).round_().clamp_(-levels, levels).to(torch.int8), x_scale


class W4ALinear(WeightsModule):
    """q [N, K] int8 codes with float32 scales [N, K / group], times activation rows rounded to
    ±`levels` per row: integer sums by `torch._int_mm` per output channel, the dequantized
    operands' float product per group."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, levels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.float())
        self.levels = levels
        # an attribute, not a buffer: derived from q and scale, and only where groups need it
        self.dense = self.dequantize(dtype) if scale.shape[1] > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        xq, x_scale = quantize_rows(rows.float(), self.levels)
        if self.dense is None:
            y = (torch._int_mm(xq, self.q.t()).float() * x_scale * self.scale.t()).to(rows.dtype)
        else:
            y = F.linear((xq.float() * x_scale).to(self.dense.dtype), self.dense).to(rows.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weights alone (the activations are rounded at run time too)."""
        n, k = self.q.shape
        groups = self.scale.shape[1]
        w = self.q.float().reshape(n, groups, k // groups) * self.scale[:, :, None]
        return w.reshape(n, k).to(dtype or torch.float32)


class W4AMethod(OnlineQuantMethod):
    def __init__(self, config: W4AConfig) -> None:
        super().__init__(config)
        group = config.group_size
        self.stored_spec = {"weight": (torch.int8, lambda k: k),
                            "weight_scale": (torch.float32, (lambda k: k // group) if group else 1)}

    def quantize(self, weight, name):
        q, scale = int4_symmetric(weight, self.config.group_size or weight.shape[1], name)
        return {"weight": q, "weight_scale": scale}

    def runtime(self, stored, dtype, name, dense_copy=True):
        q, scale = stored["weight"], stored["weight_scale"]
        levels = self.config.activation_levels
        if levels == 127 and scale.shape[1] == 1:  # w8a8's int8 product takes the codes as they are
            return W8A8Channel(q, scale[:, 0])
        return W4ALinear(q, scale, levels, dtype)


class W4AConfig(OnlineQuantConfig):
    """`rotate`: rotate the model first (the default); False quantizes the unrotated model."""

    method_class = W4AMethod
    activation_levels: int

    def __init__(self, group_size: int | None = None, from_saved: bool = False, rotate: bool = True) -> None:
        if from_saved:
            raise ValueError(f"quantization={self.name!r}: this checkpoint was saved as {self.name}, which kvflow "
                             "does not load yet (the rotation is not recorded); quantize its float checkpoint at load")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be a positive number of input channels, got {group_size}")
        super().__init__(group_size, from_saved)
        self.rotate = rotate

    def get_quant_method(self, kind: str, prefix: str):
        return W4AMethod(self) if kind == "linear" else None

    def prepare_model(self, model) -> None:
        if self.rotate:
            rotate_model(model)

    def to_dict(self) -> dict:
        raise ValueError(f"quantization={self.name!r} cannot be saved yet: the rotated model and its untied head "
                         "are not a checkpoint kvflow can load; quantize the float checkpoint at load instead")


class W4A8Config(W4AConfig):
    name = "w4a8"
    activation_levels = 127


class W4A4Config(W4AConfig):
    name = "w4a4"
    activation_levels = 7
