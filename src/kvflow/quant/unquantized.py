"""Float weights, multiplied as they are: the reference every quantized method is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.quant.base import QuantMethod, set_weight_attrs
from kvflow.quant.kernel_plan import KernelPlan
from kvflow.quant.layouts import WEIGHTS, Layouts, merged
from kvflow.quant.packed_linear import PackedWeight, gated_pair, packed_linear, product_plan, should_pack


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
        pair = gated_pair(layer, x.numel() // x.shape[-1], layer.weight.shape, lambda: layer.weight)
        return None if pair is None else pair(x)

    def kernel_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> KernelPlan:
        packed = getattr(layer, "packed_weight", None) if dtype == torch.bfloat16 else None
        return product_plan(packed, rows, lambda x: self.apply(layer, x))

    def silu_and_mul_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> KernelPlan | None:
        if getattr(layer, "packed_weight", None) is None or dtype != torch.bfloat16:
            return None
        pair = gated_pair(layer, rows, layer.weight.shape, lambda: layer.weight)
        return None if pair is None else pair.plan(rows)

    def layouts(self, layer: nn.Module) -> Layouts:
        packed, gated = getattr(layer, "packed_weight", None), getattr(layer, "gated", None)
        return merged({WEIGHTS: [layer.weight]}, packed.layouts() if packed is not None else {},
                      gated.layouts() if gated is not None else {})

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)
