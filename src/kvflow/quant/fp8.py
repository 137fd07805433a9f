"""fp8: E4M3 weights with one scale per output channel, weight-only; the embedding and head stay
in the model's dtype, as vLLM leaves them.

E4M3 keeps 3 mantissa bits, so every weight is off by up to 1/16 of itself whatever the scale.
Rounded to nearest, that cost SmolLM2-135M 4.3% perplexity (docs/performance-journal.md). So where the
engine can calibrate (a tokenizer, one process) the linear layers are rounded by GPTQ
(quant/gptq.py) on 8,192 tokens of the shipped text, each row's scale first shifted by a fraction
of a binade to where its weights, weighed by their inputs, land nearest the grid. Elsewhere, and
in unit tests of the format, they are rounded to nearest.

This CPU has no FP8 matmul (`torch._scaled_mm` on CPU and a plain fp8 → bf16 cast both took ~19 ms
for a 3072×576 matrix, 80× the bf16 matmul), so each call decodes the codes to the model dtype and
multiplies densely: the format is here for its quality and its bytes at rest, not for CPU speed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.quant.calibration import InputStats
from kvflow.quant.formats import check_finite, e4m3_encode, fp8_channel_scale, fp8_per_channel
from kvflow.quant.gptq import gptq_round
from kvflow.quant.int8 import Int8Channel, Int8Method
from kvflow.quant.online import CalibratedMethod, OnlineQuantConfig

SCALE_SHIFTS = 16  # candidate scales per row: the max-abs one times 2^(j/16), j = 0..15


class Fp8Channel(Int8Channel):
    """Codes times a per-row scale, as int8's, but always decoded: no kernel reads E4M3 here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))


def shifted_scales(w: torch.Tensor, input_power: torch.Tensor) -> torch.Tensor:
    """Per row of w [N, K], the scale among the max-abs scale times 2^(j / SCALE_SHIFTS) (none
    clips) whose rounded row is nearest w, each column's error weighed by input_power [K]
    (E[x²] of its input)."""
    base = fp8_channel_scale(w)
    best_err, best = None, base
    for j in range(SCALE_SHIFTS):
        scale = base * 2 ** (j / SCALE_SHIFTS)
        err = ((w - e4m3_encode(w / scale[:, None]).float() * scale[:, None]).square() * input_power).sum(1)
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, scale, best)
    return best


class Fp8Method(CalibratedMethod, Int8Method):
    stored_spec = {"weight": (torch.float8_e4m3fn, lambda k: k), "weight_scale": (torch.float32, None)}
    folds_scale = False
    wants_gram = True

    def finish_calibration(self, layer, inputs: InputStats) -> None:
        layer.calibrated = True
        self.install(layer, self.quantize_by_inputs(layer.weight.data, inputs.gram, layer.prefix))

    def quantize(self, weight, name):
        """Uncalibrated (no tokenizer, several ranks, unit tests of the format): to nearest."""
        q, scale = fp8_per_channel(weight, name)
        return {"weight": q, "weight_scale": scale}

    def quantize_by_inputs(self, weight: torch.Tensor, gram: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        """Scales shifted to the grid, then GPTQ, both weighed by the inputs' second moment `gram`."""
        check_finite(weight, name)
        w = weight.float()
        scale = shifted_scales(w, gram.diagonal())
        rounded = gptq_round(w, gram, lambda column: e4m3_encode(column / scale).float() * scale)
        return {"weight": e4m3_encode(rounded / scale[:, None]), "weight_scale": scale}

    def runtime(self, stored, dtype, name, dense_copy=True):
        return Fp8Channel(stored["weight"], stored["weight_scale"], dtype)


class Fp8Config(OnlineQuantConfig):
    name = "fp8"
    method_class = Fp8Method
    calibrates = True
    calibration_tokens = 8192
    rounds_uncalibrated = True

    def get_quant_method(self, kind: str, prefix: str):
        return Fp8Method(self) if kind == "linear" else None
