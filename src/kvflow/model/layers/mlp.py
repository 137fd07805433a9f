"""The gated feed-forward block: down(act(gate(x)) * up(x)), gate and up as one matmul.

Under tensor parallelism gate/up split by output channels and down by input channels, so each
rank computes its slice of the intermediate activations and a partial sum of the output; down
all-reduces it, unless `reduce_results=False` leaves that to the caller (a mixture of experts sums
its experts' partial outputs and reduces once).

SiLU MLPs ask the gate/up layer for SiLU(gate)·up in one pass first (`silu_and_mul`: its quant
method's fused product, where it has one for x), and apply the activation kernel to the plain
product otherwise; a model built with `custom_ops="none"` never fuses and takes the torch code."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.cpu_extension import current_kernels
from kvflow.model.layers.activation import ACTIVATIONS, torch_silu_and_mul
from kvflow.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from kvflow.quant.base import QuantizationConfig


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, quant_config: QuantizationConfig | None,
                 prefix: str, activation: str = "silu", reduce_results: bool = True) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"{prefix}: activation {activation!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False,
                                                       quant_config, f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, quant_config, f"{prefix}.down_proj",
                                           reduce_results=reduce_results)
        custom_ops = current_kernels().custom_ops
        self.fused_silu = custom_ops and activation == "silu"  # the gate/up layer may fuse SiLU·up
        self.act_and_mul = ACTIVATIONS[activation] if custom_ops or activation != "silu" else torch_silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.gate_up_proj.silu_and_mul(x) if self.fused_silu else None
        return self.down_proj(act if act is not None else self.act_and_mul(self.gate_up_proj(x)))
