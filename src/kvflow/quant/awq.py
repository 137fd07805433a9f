"""awq: activation-aware int4 (Lin et al., 2023), and AutoAWQ's GEMM checkpoint format.

Input channels that see large activations matter more, so before rounding W to int4 per group,
scale those columns up by s (and divide the layer's input by s, which is folded into the op that
produces it, so the model's function is unchanged): W·x = (W·diag(s)) · (x / s). With s =
mean|x|^α, α is searched per layer on calibration activations for the smallest output error of
the quantized layer (the pass, the folds and the order: quant/calibration.py).

Saved and loaded as AutoAWQ's GEMM layout: qweight int32 [K, N/8] and qzeros int32 [K/G, N/8]
(eight 4-bit values per int32, in the order 0 2 4 6 1 3 5 7), scales [K/G, N]; w = (q − z)·s.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.quant.calibration import ALPHAS, InputStats
from kvflow.quant.formats import int4_per_group
from kvflow.quant.int4pack import Int4Planes, planes_from_affine
from kvflow.quant.int8 import Int8Method
from kvflow.quant.online import CalibratedMethod, OnlineQuantConfig

_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k of an int32 holds column _AWQ_ORDER[k] of its 8


class AWQConfig(OnlineQuantConfig):
    """The embedding and head are int8 per row, as with int4 (kvflow's checkpoints say so with
    "embedding": "int8"); AutoAWQ's own checkpoints keep them float."""

    name = "awq"
    calibrates = True

    def __init__(self, group_size: int | None = None, from_saved: bool = False, int8_embedding: bool = True) -> None:
        super().__init__(group_size or 32, from_saved)
        self.int8_embedding = int8_embedding

    def get_quant_method(self, kind: str, prefix: str):
        if kind == "linear":
            return AWQMethod(self)
        return Int8Method(self) if self.int8_embedding else None

    def to_dict(self) -> dict:
        return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True, "version": "gemm",
                "embedding": "int8" if self.int8_embedding else "float"}


class AWQMethod(CalibratedMethod):
    def __init__(self, config: AWQConfig) -> None:
        super().__init__(config)
        self.stored_spec = {"qweight": (torch.int32, None), "qzeros": (torch.int32, None), "scales": (torch.float32, None)}
        self._g = config.group_size

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        if not self.config.from_saved:
            return super().create_weights(layer, input_size, output_sizes, params_dtype)
        layer.quant_dtype, n, g = params_dtype, sum(output_sizes), self._g
        if input_size % g:
            raise ValueError(f"{layer.prefix}: group size {g} does not divide its {input_size} input channels")
        shapes = {"qweight": (input_size, n // 8), "qzeros": (input_size // g, n // 8), "scales": (input_size // g, n)}
        for name, shape in shapes.items():
            dtype = torch.float32 if name == "scales" else torch.int32
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.output_dim, param.weight_loader = 1, layer.weight_loader
            if name != "scales":
                param.packed_dim, param.packed_factor = 1, 8
            layer.register_parameter(name, param)

    def stored_tensors(self, layer):
        return {name: (getattr(layer, name), 1, 1 if name == "scales" else 8) for name in self.stored_spec}

    def search_scale(self, weight: torch.Tensor, inputs: InputStats, name: str) -> tuple[torch.Tensor, float]:
        """s = mean|x|^α (normalised), α from `ALPHAS`, that minimises ‖x·Wᵀ − x·(Q(W·s)/s)ᵀ‖ on the
        sample rows for round-to-nearest int4 Q with the configured group size."""
        x, group = inputs.sample, self._g
        reference = x @ weight.t()
        best = (float("inf"), None, 0.0)
        for alpha in ALPHAS:
            s = inputs.abs_mean.clamp(min=1e-4).pow(alpha)
            s = s / (s.max() * s.min()).sqrt()
            u, scale, minimum = int4_per_group(weight * s, group, name)
            n, k = weight.shape
            dq = (u.view(n, k // group, group).float() * scale[..., None] + minimum[..., None]).view(n, k) / s
            err = (x @ dq.t() - reference).pow(2).mean().item()
            if err < best[0]:
                best = (err, s, alpha)
        return best[1], best[2]

    def quantize(self, weight, name):
        u, scale, minimum = int4_per_group(weight, self._g, name)
        zeros = (-minimum / scale).round().clamp(0, 15)  # AWQ stores an integer zero point
        u = ((weight.float().view(*scale.shape, -1) / scale[..., None]).round() + zeros[..., None]).clamp(0, 15)
        return {"qweight": _pack_awq(u.view(weight.shape).to(torch.int32).t()),
                "qzeros": _pack_awq(zeros.to(torch.int32).t()), "scales": scale.t().contiguous()}

    def runtime(self, stored, dtype, name, dense_copy=True):
        u = _unpack_awq(stored["qweight"]).t()  # [N, K]
        zeros, scales = _unpack_awq(stored["qzeros"]).t().float(), stored["scales"].t().float()
        return Int4Planes(planes_from_affine(u.to(torch.uint8), scales, -zeros * scales, 4), self._g, dtype, name,
                          dense_copy)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit values → [R, C/8] int32 in AWQ's interleaved order."""
    v = values.view(values.shape[0], -1, 8)[..., _AWQ_ORDER].to(torch.int64)
    packed = sum(v[..., k] << (4 * k) for k in range(8))
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed[..., None] >> shifts) & 0x0F  # [R, C/8, 8] in stored order
    inverse = torch.argsort(torch.tensor(_AWQ_ORDER))
    return nibbles[..., inverse].reshape(packed.shape[0], -1)
