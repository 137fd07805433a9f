"""awq: activation-aware int4 (Lin et al., 2023), and AutoAWQ's GEMM checkpoint format.

Input channels that see large activations matter more, so before rounding W to int4 per group,
scale those columns up by s (and divide the layer's input by s, which is folded into the op that
produces it, so the model's function is unchanged): W·x = (W·diag(s)) · (x / s). With s =
mean|x|^α, α is searched per layer on calibration activations for the smallest output error of
the layer as it will run: W·s in the layer's dtype, rounded exactly as int4 rounds (the same
groups, scale and float minimum), dequantized as the runtime does, its input divided by s as the
fold writes it (the pass, the folds and the order: quant/calibration.py). α = 0 (s = 1) is in the
grid and is plain int4 bit for bit, so the search never chooses worse than int4 on its sample.

Saved in AutoAWQ's GEMM layout: qweight int32 [K, N/8] (eight 4-bit values per int32, in the
order 0 2 4 6 1 3 5 7) and scales [K/G, N]. The zero differs: AutoAWQ stores an integer zero
point, qzeros int32 [K/G, N/8], w = (q − z)·s, and such checkpoints load; kvflow stores int4's
float minimum, mins [K/G, N], w = s·q + min ("zeros": "float" in its config). An integer zero
moves a group's grid by up to half a step: on the default model, whose weights come from Q4_1
blocks (a float minimum each), that re-rounded every weight (8% RMS at G32, where int4 is exact)
and cost +45% perplexity.
"""

from __future__ import annotations

import torch

from kvflow.quant.calibration import ALPHAS, InputStats
from kvflow.quant.formats import int4_per_group
from kvflow.quant.int4 import DEFAULT_GROUP_SIZE, dequantize_as_run
from kvflow.quant.int4pack import Int4Planes, pack, planes_from_affine, unpack
from kvflow.quant.int8 import Int8Method
from kvflow.quant.online import CalibratedMethod, OnlineQuantConfig, register_stored

_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k of an int32 holds column _AWQ_ORDER[k] of its 8


class AWQConfig(OnlineQuantConfig):
    """The embedding and head are int8 per row, as with int4 (kvflow's checkpoints say so with
    "embedding": "int8"); AutoAWQ's own checkpoints keep them float, and store integer zero points.
    `float_zeros`: the checkpoint holds int4's float minimums (kvflow's since they say "zeros":
    "float"), not integer zero points (AutoAWQ's, and kvflow's before); unset, as the embedding."""

    name = "awq"
    calibrates = True

    def __init__(self, group_size: int | None = None, from_saved: bool = False, int8_embedding: bool = True,
                 float_zeros: bool | None = None) -> None:
        super().__init__(group_size or DEFAULT_GROUP_SIZE, from_saved)
        self.int8_embedding = int8_embedding
        self.float_zeros = int8_embedding if float_zeros is None else float_zeros
        if not (from_saved or self.float_zeros):
            raise ValueError("awq: float_zeros=False (AutoAWQ's integer zero points) is for loading its "
                             "checkpoints; quantizing writes int4's float minimum")

    def get_quant_method(self, kind: str, prefix: str):
        if kind == "linear":
            return AWQMethod(self)
        return Int8Method(self) if self.int8_embedding else None

    def to_dict(self) -> dict:
        return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True, "version": "gemm",
                "embedding": "int8" if self.int8_embedding else "float"} | ({"zeros": "float"} if self.float_zeros else {})


class AWQMethod(CalibratedMethod):
    def __init__(self, config: AWQConfig) -> None:
        super().__init__(config)
        zeros = ("mins", torch.float32) if config.float_zeros else ("qzeros", torch.int32)
        self.stored_spec = {"qweight": (torch.int32, None), zeros[0]: (zeros[1], None), "scales": (torch.float32, None)}
        self._g = config.group_size

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        if not self.config.from_saved:
            return super().create_weights(layer, input_size, output_sizes, params_dtype)
        layer.quant_dtype, n, g = params_dtype, sum(output_sizes), self._g
        if input_size % g:
            raise ValueError(f"{layer.prefix}: group size {g} does not divide its {input_size} input channels")
        shapes = {"qweight": (input_size, n // 8), "qzeros": (input_size // g, n // 8), "mins": (input_size // g, n),
                  "scales": (input_size // g, n)}
        by_output = dict(output_dim=1, weight_loader=layer.weight_loader)
        packed = dict(packed_dim=1, packed_factor=8)  # qweight, qzeros: eight 4-bit values per element
        register_stored(layer, {name: (dtype, shapes[name], by_output | (packed if dtype == torch.int32 else {}))
                                for name, (dtype, _) in self.stored_spec.items()})

    def stored_tensors(self, layer):
        return {name: (getattr(layer, name), 1, 8 if dtype == torch.int32 else 1)
                for name, (dtype, _) in self.stored_spec.items()}

    def search_scale(self, weight: torch.Tensor, inputs: InputStats, name: str) -> tuple[torch.Tensor, float]:
        """s = mean|x|^α (normalised), α from `ALPHAS`, that minimises ‖x·Wᵀ − x·W_α‖ on the sample
        rows, W_α being what the layer will run with (`effective_weight`). `weight` as the layer stores it:
        its dtype is the one the fold and the runtime round to."""
        x, dtype, weight = inputs.sample, weight.dtype, weight.float()
        reference = x @ weight.t()
        best = (float("inf"), None, 0.0)
        for alpha in ALPHAS:
            s = candidate_scale(inputs.abs_mean, alpha)
            err = (x @ self.effective_weight(weight, s, name, dtype).t() - reference).pow(2).mean().item()
            if err < best[0]:  # ties keep the smaller α: α = 0 (plain int4) unless another is better
                best = (err, s, alpha)
        return best[1], best[2]

    def effective_weight(self, weight: torch.Tensor, s: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] (float) as the layer multiplies its unscaled input once s is folded in: W·s in
        the layer's `dtype` (as calibration writes it), rounded as `quantize` stores it, dequantized
        as the runtime holds it, times the 1/s the fold gives the op that feeds it."""
        scaled = weight.to(dtype) * s.to(dtype)
        u, scale, minimum = int4_per_group(scaled, self._g, name)
        stored = dequantize_as_run(u, scale, minimum, self._g, dtype).float()
        return stored * (1 / s).to(dtype).float()

    def quantize(self, weight, name):
        """int4's rounding (formats.int4_per_group), in AWQ's layout: the same weights as `-q int4`."""
        u, scale, minimum = int4_per_group(weight, self._g, name)
        return {"qweight": _pack_awq(u.to(torch.int32).t()), "mins": minimum.t().contiguous(),
                "scales": scale.t().contiguous()}

    def runtime(self, stored, dtype, name, dense_copy=True):
        u = _unpack_awq(stored["qweight"]).t()  # [N, K]
        scales = stored["scales"].t().float()
        if "mins" in stored:
            minimum = stored["mins"].t().float()
        else:  # AutoAWQ: w = (q − z)·s
            minimum = -_unpack_awq(stored["qzeros"]).t().float() * scales
        return Int4Planes(planes_from_affine(u.to(torch.uint8), scales, minimum, 4), self._g, dtype, name, dense_copy)


def candidate_scale(abs_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """mean|x|^α per input channel, normalised so that its largest and smallest are reciprocal
    (the weights and the norm keep their magnitudes); exactly 1 at α = 0 (x^0 = 1, so 1/√(1·1)), so
    that α is plain int4."""
    s = abs_mean.clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit values → [R, C/8] int32 in AWQ's interleaved order."""
    return pack(values.view(values.shape[0], -1, 8)[..., _AWQ_ORDER].flatten(1), 4)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """`_pack_awq`'s inverse: the nibbles in stored order, put back in column order."""
    nibbles = unpack(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    return nibbles[..., torch.argsort(torch.tensor(_AWQ_ORDER))].flatten(1)
