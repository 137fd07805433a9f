"""The gated feed-forward block: down(act(gate(x)) * up(x)), gate and up as one matmul."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.model.layers.activation import ACTIVATIONS, silu_and_mul
from kvflow.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from kvflow.quant.base import QuantizationConfig


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, quant_config: QuantizationConfig | None,
                 prefix: str, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"{prefix}: activation {activation!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False,
                                                       quant_config, f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, quant_config, f"{prefix}.down_proj")
        self.act_and_mul = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.gate_up_proj.silu_and_mul(x) if self.act_and_mul is silu_and_mul else None
        return self.down_proj(act if act is not None else self.act_and_mul(self.gate_up_proj(x)))
