"""int4: weight-only, asymmetric, one (scale, min) per group of `group_size` input channels
(32 by default; 64 and 128 too), rounded to nearest; run as one plane on aten's int4 kernel."""

from __future__ import annotations

import torch

from kvflow.quant.formats import int4_per_group, pack_nibbles, unpack_nibbles
from kvflow.quant.int4pack import Int4Planes, planes_from_affine, planes_sum
from kvflow.quant.int8 import Int8Method
from kvflow.quant.online import OnlineQuantConfig, OnlineQuantMethod

DEFAULT_GROUP_SIZE = 32


def dequantize_as_run(u: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` as `Int4Planes` built from (u, scale, min) holds it: its scale and zero
    rounded to `dtype`, summed in float32, rounded once. AWQ's search scores this, not the float
    grid, so that what it minimises is what the layer multiplies by (tests hold it to the module)."""
    ((q, plane_scale, zero),) = planes_from_affine(u, scale, minimum, 4)
    return planes_sum([(q, plane_scale.to(dtype), zero.to(dtype))], group).to(dtype)

class Int4Method(OnlineQuantMethod):
    def __init__(self, config) -> None:
        super().__init__(config)
        g = config.group_size
        self.stored_spec = {"qweight": (torch.uint8, lambda k: k // 2),
                            "scales": (torch.float32, lambda k: k // g), "mins": (torch.float32, lambda k: k // g)}

    def quantize(self, weight, name):
        u, scale, minimum = int4_per_group(weight, self.config.group_size, name)
        return {"qweight": pack_nibbles(u), "scales": scale, "mins": minimum}

    def runtime(self, stored, dtype, name, dense_copy=True):
        u = unpack_nibbles(stored["qweight"])
        return Int4Planes(planes_from_affine(u, stored["scales"], stored["mins"], 4), self.config.group_size, dtype, name,
                          dense_copy)


class Int4Config(OnlineQuantConfig):
    """The embedding and (tied) LM head stay at int8 per row, as llama.cpp's Q4 files keep their
    output matrix wider: at int4 the head alone doubled the default model's perplexity."""

    name = "int4"
    method_class = Int4Method

    def __init__(self, group_size: int | None = None, from_saved: bool = False) -> None:
        super().__init__(group_size or DEFAULT_GROUP_SIZE, from_saved)

    def get_quant_method(self, kind: str, prefix: str):
        return self.method_class(self) if kind == "linear" else Int8Method(self)
