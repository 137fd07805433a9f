"""Float weights, multiplied as they are: the reference every quantized method is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.quant.base import QuantMethod, set_weight_attrs
from kvflow.quant.packed_linear import PackedWeight, gated_silu_and_mul, packed_linear, should_pack


class UnquantizedMethod(QuantMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        layer.register_parameter("weight", set_weight_attrs(weight, output_dim=0, input_dim=1,
                                                            weight_loader=layer.weight_loader))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # bf16 on CPU: oneDNN's layout once, not at every call (packed_linear.py). An attribute, not
        # a buffer: the opaque tensor stays out of state_dict; `weight` stays the float truth.
        if should_pack(layer.weight):
            layer.packed_weight = PackedWeight(layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = getattr(layer, "packed_weight", None)
        if packed is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return packed_linear(x, packed, bias)
        return F.linear(x, layer.weight, bias)

    def silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        if getattr(layer, "packed_weight", None) is None or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return None
        return gated_silu_and_mul(layer, x, lambda: layer.weight)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)
